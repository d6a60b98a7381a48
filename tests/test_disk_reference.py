"""The benchmarks' disk references (benchmarks/disk_reference.py): raw sequential, raw mixed, the store's own path.

They live outside the package (measurement tools are not on the training path), but the benchmarks' figures rest
on them, so they are tested here: each moves every byte, leaves nothing behind and fails in one clear line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import is_aligned

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import disk_reference  # noqa: E402


def test_store_bandwidth_reference(tmp_path):
    bw = disk_reference.measure_store(tmp_path, 8 << 20, tensor_bytes=3 << 20)
    assert bw.nbytes == 8 << 20 and bw.read_Bps > 0 and bw.write_Bps > 0
    assert list(tmp_path.iterdir()) == []


def test_raw_mixed_read_write_probe(tmp_path):
    # Reads and writes at once, as a training step does: a positive time, and nothing left in the folder.
    staging = disk_reference.staging_buffer(4 << 20)
    try:
        seconds = disk_reference.measure_raw_mixed(tmp_path, 6 << 20, 3 << 20, block_bytes=1 << 20, staging=staging)
    except UsageError as e:  # a filesystem without O_DIRECT (tmpfs): said in one line, naming the folder
        assert "O_DIRECT" in str(e) and str(tmp_path) in str(e)
    else:
        assert seconds > 0
    assert list(tmp_path.iterdir()) == []


def test_raw_mixed_disk_reuses_laid_out_files(tmp_path):
    # Repeated measurements reuse two scratch files, written before any timing and grown on demand, so the timed
    # writes overwrite data as the tier's in-place writes do; close() removes them.
    staging = disk_reference.staging_buffer(4 << 20)
    try:
        disk = disk_reference.RawMixedDisk(tmp_path, block_bytes=1 << 20, staging=staging)
        first = disk.seconds(2 << 20, 1 << 20)
    except UsageError as e:
        assert "O_DIRECT" in str(e) and str(tmp_path) in str(e)
        return
    with disk:
        assert first > 0
        sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
        assert sizes == [1 << 20, 2 << 20]
        assert disk.seconds(3 << 20, 1 << 20) > 0
        sizes = sorted(p.stat().st_size for p in tmp_path.iterdir())
        assert sizes == [1 << 20, 3 << 20]  # the read file grew; the write file was big enough
        for p in tmp_path.iterdir():
            assert p.read_bytes().count(0) < p.stat().st_size // 2  # laid out with random bytes, not holes
    assert list(tmp_path.iterdir()) == []


def test_raw_mixed_through_the_pools_idle_buffers(tmp_path):
    # The benchmark's same-memory reference: the pool lends its idle buffers (as bytes, lent ones left out) and the
    # raw loop moves its blocks through them, allocating nothing of its own.
    from tightfit.offload.runtime.host_memory import HostPool

    pool = HostPool(capacity=None)
    lent = pool.reserve("kept", {"b": (1 << 18, torch.float32)})["b"]  # 1 MiB, stays granted
    grant = pool.reserve("idle", {"a": (1 << 18, torch.float32), "b": (1 << 18, torch.float32)})
    idle = list(grant.bufs.values())
    grant.release()
    got = pool.idle_buffers()
    assert len(got) == 2 and all(g.dtype == torch.uint8 and g.numel() == 1 << 20 for g in got)
    assert {g.data_ptr() for g in got} == {b.data_ptr() for b in idle} and lent.data_ptr() not in {
        g.data_ptr() for g in got}
    try:
        with disk_reference.RawMixedDisk(tmp_path, block_bytes=1 << 20) as disk:
            assert disk.seconds(2 << 20, 1 << 20, memory=got) > 0
            assert disk.staging is None  # nothing allocated: the pool's memory carried every block
            with pytest.raises(ValueError, match="at least one"):
                disk.seconds(1 << 20, 1 << 20, memory=[g[: 1 << 19] for g in got])
    except UsageError as e:
        assert "O_DIRECT" in str(e)


def test_bandwidth_through_small_shared_staging(tmp_path):
    # A volume larger than the staging memory cycles through it (both measurements), and still moves every byte.
    staging = disk_reference.staging_buffer(6 << 20, max_bytes=2 << 20)
    assert staging.numel() == 2 << 20 and is_aligned(staging)
    raw = disk_reference.measure_raw(tmp_path, 6 << 20, block_bytes=1 << 20, queue_depth=2, use_fio=False,
                                 staging=staging)
    assert raw.nbytes == 6 << 20 and raw.method in ("python-direct", "python-buffered")
    st = disk_reference.measure_store(tmp_path, 6 << 20, tensor_bytes=4 << 20, staging=staging)
    assert st.nbytes == 6 << 20
    with pytest.raises(ValueError, match="4096-aligned uint8"):
        disk_reference.measure_store(tmp_path, 1 << 20, staging=torch.zeros(1 << 20, dtype=torch.float32))


def test_parse_fio_json():
    out = 'fio: note\n{"jobs": [{"read": {"bw_bytes": 100}, "write": {"bw_bytes": 0}},' \
          ' {"read": {"bw_bytes": 50}, "write": {"bw_bytes": 7}}]}'
    assert disk_reference.parse_fio_bw(out, "read") == 150.0
    assert disk_reference.parse_fio_bw(out, "write") == 7.0
