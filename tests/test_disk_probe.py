"""The disk probe and the NVMe tier's tuning ([Note: disk tuning] in tightfit/offload/tiers/nvme/tuning.py).

`tightfit probe` measures the swap folder's disk (bandwidth, the largest transfer, the I/O threads) and caches it;
the store takes the cached tuning only for a folder on the filesystem that was measured, else the defaults, and
never measures anything itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tightfit.offload.tiers.nvme import store as nvme
from tightfit.offload.tiers.nvme.store import DEFAULT_TUNING, DiskTuning, NvmeStore, device_of, disk_tuning
from tightfit.offload.placement import Placement, Tier
from tightfit.planner import disk_probe
from tightfit.planner.hardware import HardwareProfile, save_cached


def test_raw_bandwidth_probe(tmp_path):
    read_bps, write_bps = disk_probe.measure_raw_bandwidth(tmp_path, 8 << 20, block_bytes=1 << 20)
    assert read_bps > 0 and write_bps > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_probe_disk_finds_threads_and_transfer_size(tmp_path):
    found = disk_probe.probe_disk(tmp_path, 8 << 20)
    assert found.read_Bps > 0 and found.write_Bps > 0
    assert found.threads in disk_probe.THREAD_CHOICES
    assert 4096 <= found.chunk_bytes <= disk_probe.MAX_TRANSFER and found.chunk_bytes % 4096 == 0
    assert found.device == device_of(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _fake_sysfs(root: Path, dev: str, kib: str | None, partition: bool) -> None:
    """sysfs as the kernel lays it out: /sys/dev/block/MAJ:MIN -> the device (or a partition inside its disk)."""
    disk = root / "devices" / "vda"
    node = disk / "vda1" if partition else disk
    node.mkdir(parents=True)
    if kib is not None:
        (disk / "queue").mkdir()
        (disk / "queue" / "max_sectors_kb").write_text(kib + "\n")
    (root / "dev" / "block").mkdir(parents=True)
    os.symlink(node, root / "dev" / "block" / dev)


@pytest.mark.parametrize("kib, partition, want", [
    ("1280", False, 1280 << 10),   # the device's limit
    ("1280", True, 1280 << 10),    # a partition: its disk's queue
    ("32767", False, 4 << 20),     # capped at 4 MiB
    ("6", False, 4096),            # whole 4096-byte blocks
    (None, False, 4 << 20),        # no queue: unknown
])
def test_largest_transfer_comes_from_the_block_device(tmp_path, kib, partition, want):
    sysfs = tmp_path / "sys"
    _fake_sysfs(sysfs, device_of(tmp_path), kib, partition)
    assert disk_probe.max_transfer_bytes(tmp_path, sysfs=sysfs) == want


def _profile(device: str, threads: int, chunk: int) -> HardwareProfile:
    from tightfit.planner.hardware import machine_key

    return replace(HardwareProfile.synthetic(key=machine_key()), nvme_device=device, nvme_io_threads=threads,
                   nvme_chunk_bytes=chunk)


def test_the_store_takes_the_probes_tuning_for_the_measured_filesystem_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path / "cache"))
    swap = tmp_path / "swap" / "not-yet-created"
    assert disk_tuning(swap) == DEFAULT_TUNING  # no cached profile
    save_cached(_profile(device_of(tmp_path), 16, 1 << 20))
    assert disk_tuning(swap) == DiskTuning(threads=16, chunk_bytes=1 << 20)  # its nearest existing parent's disk
    with NvmeStore(swap) as s:
        assert s.threads == 16 and s.chunk_bytes == 1 << 20
    with NvmeStore(swap, threads=2) as s:  # an explicit value wins; the other is still derived
        assert s.threads == 2 and s.chunk_bytes == 1 << 20
    save_cached(_profile("12345:6", 16, 1 << 20))  # measured on another filesystem
    assert disk_tuning(swap) == DEFAULT_TUNING
    save_cached(_profile(device_of(tmp_path), 0, 1000))  # nonsense in the cache: the defaults, not an error
    assert disk_tuning(swap) == DEFAULT_TUNING


def test_old_profiles_and_plans_still_load():
    hw = HardwareProfile.from_dict({k: v for k, v in HardwareProfile.synthetic().to_dict().items()
                                    if not k.startswith("nvme_") or k in ("nvme_free", "nvme_read_bw",
                                                                         "nvme_write_bw")})
    assert hw.nvme_device == "" and hw.nvme_io_threads == 8 and hw.nvme_chunk_bytes == 4 << 20
    old = Placement.everywhere(Tier.NVME, nvme_dir="/x").to_dict() | {
        "nvme_threads": 4, "nvme_chunk_bytes": 1 << 20, "staging_buffers": 6}
    assert Placement.from_dict(old) == Placement.everywhere(Tier.NVME, nvme_dir="/x")
    with pytest.raises(TypeError):  # other unknown keys are still mistakes
        Placement.from_dict(old | {"prefetch_dpeth": 3})


def test_wrapping_measures_nothing(tmp_path, monkeypatch):
    # disk_tuning reads a cache; it must never run the probe (seconds of disk traffic at every wrap).
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(disk_probe, "probe_disk", lambda *a, **k: pytest.fail("measured at wrap time"))
    monkeypatch.setattr(disk_probe, "measure_raw", lambda *a, **k: pytest.fail("measured at wrap time"))
    assert nvme.disk_tuning(tmp_path) == DEFAULT_TUNING


def test_sustained_bandwidth_times_the_second_half_of_what_it_writes(tmp_path, monkeypatch):
    """[Note: sustained bandwidth]: a disk whose first writes land in a fast cache. The file is written twice over;
    the write rate reported is the rate once that cache is full (the second half of the segments: the rewrite),
    the read rate is over the file, and the scratch file is gone."""
    calls = []

    def fake_run_blocks(fd, views, nblocks, block_bytes, queue_depth, write, first=0):
        calls.append((write, first, nblocks))
        if write:  # the first pass: 4x faster (a cache), the rewrite at the disk's own speed
            return 0.25 if len(calls) <= 16 else 1.0
        return 2.0

    monkeypatch.setattr(disk_probe, "run_blocks", fake_run_blocks)
    seg = 1 << 20
    read_bps, write_bps, mixed_bps, volume = disk_probe.measure_sustained(tmp_path, 16 * seg, block_bytes=seg,
                                                                          queue_depth=2)
    assert volume == 16 * seg
    writes = [c for c in calls[:32] if c[0]]
    assert [c[1] for c in writes] == list(range(16)) * 2  # segment after segment, twice over
    assert write_bps == pytest.approx(seg / 1.0)
    assert read_bps == pytest.approx(16 * seg / 2.0)
    assert calls[32] == (False, 0, 16)
    # Then the first half read while the second half is rewritten, at once.
    assert sorted(calls[33:]) == [(False, 0, 8), (True, 8, 8)]
    assert mixed_bps > 0
    assert list(tmp_path.iterdir()) == []


def test_sustained_bandwidth_stops_at_its_time_limit(tmp_path):
    read_bps, write_bps, mixed_bps, volume = disk_probe.measure_sustained(tmp_path, 64 << 20, max_write_s=0.0,
                                                                           block_bytes=1 << 20)
    assert read_bps > 0 and write_bps > 0 and mixed_bps > 0  # two segments at least, then stopped
    assert volume == 2 * (4 << 20)  # the rates hold for what the file held: two of its 16 segments
    assert list(tmp_path.iterdir()) == []


def test_the_sustained_time_limit_grows_with_the_volume(tmp_path, monkeypatch):
    """A 48 GiB volume on a disk that sustains 1 GB/s takes 103 s to write twice over: the default limit (40 s,
    what 16 GiB needs) would have stopped it before the second pass. The fake disk writes a segment per 3 s."""
    clock = [0.0]

    def fake_run_blocks(fd, views, nblocks, block_bytes, queue_depth, write, first=0):
        clock[0] += 3.0
        return 3.0

    monkeypatch.setattr(disk_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(disk_probe, "run_blocks", fake_run_blocks)
    segments = []
    monkeypatch.setattr(disk_probe._ScratchFile, "seconds",
                        lambda self, *a, write, **k: segments.append(write) or fake_run_blocks(0, 0, 0, 0, 0, write))
    disk_probe.measure_sustained(tmp_path, 16 << 20, block_bytes=1 << 20)
    assert segments.count(True) == 14 + 1  # 40 s at 3 s a segment, then the mixed pass's write
    assert disk_probe.write_limit_s(16 << 30) == 40.0
    assert disk_probe.write_limit_s(48 << 30) >= 2 * (48 << 30) / 1e9


def test_probe_with_a_swap_folder_reports_the_sustained_rates(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_probe, "measure_sustained", lambda folder, nbytes, **kw: (1.5e9, 0.5e9, 0.8e9, nbytes))
    found = disk_probe.probe_disk(tmp_path, 8 << 20, sustained_bytes=64 << 20)
    assert (found.read_Bps, found.write_Bps, found.mixed_Bps) == (1.5e9, 0.5e9, 0.8e9)
    assert found.measured_bytes == 64 << 20
    assert disk_probe.probe_disk(tmp_path, 8 << 20).measured_bytes == 8 << 20  # a burst: its own bytes


def test_the_disk_time_of_a_phase_is_no_less_than_its_bytes_at_the_mixed_rate():
    """[Note: sustained bandwidth]: 4 GB/s each way alone, 1.6 GB/s in all with both in flight (the 3B run's disk)."""
    from tightfit.planner.costs import disk_time
    from tightfit.planner.hardware import HardwareProfile

    hw = HardwareProfile.synthetic(nvme_read_bw=4e9, nvme_write_bw=4e9)
    assert disk_time(8e9, 8e9, hw) == pytest.approx(4.0)  # not measured: read time + write time
    mixed = replace(hw, nvme_mixed_bw=1.6e9)
    assert disk_time(8e9, 8e9, mixed) == pytest.approx(10.0)
    assert disk_time(8e9, 0, mixed) == pytest.approx(2.0)  # one direction alone: its own rate
    fast_mix = replace(hw, nvme_mixed_bw=100e9)
    assert disk_time(8e9, 8e9, fast_mix) == pytest.approx(4.0)  # never below the two directions' own times


@pytest.mark.slow  # a whole probe of this machine, ~15-30 s: `make test-slow`
def test_a_plan_without_a_cached_profile_probes_quickly_and_apart(tmp_path):
    """A plan that finds no cached profile measures the disk's burst only (the sustained measurement, up to a minute
    and gigabytes written, is `tightfit probe --nvme`'s), in a child process with the run's thread count: the
    probe's ~0.8 GiB of buffers stay out of the run's RSS high-water mark, the peak a run compares with its plan
    (they made a first run's peak 904 MiB against 549 predicted). A fresh process, so its high-water mark is its own."""
    code = ("import json, sys, torch\n"
            "torch.set_num_threads(1)\n"
            "from tightfit.planner.hardware import load_cached\n"
            "from tightfit.planner.probe import load_or_probe\n"
            "from tightfit.train.memory import _rss_high_water\n"
            "before = _rss_high_water()\n"
            "hw = load_or_probe(sys.argv[1])\n"
            "print(json.dumps({'grew': _rss_high_water() - before, 'volume': hw.nvme_measured_bytes,\n"
            "                  'threads': hw.threads, 'cached': load_cached().matmul_flops == hw.matmul_flops}))\n")
    env = dict(os.environ, TIGHTFIT_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "swap")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["grew"] < 128 << 20, out  # the probe's copies alone are 768 MiB
    assert out["volume"] <= 256 << 20 and out["threads"] == 1, out  # the burst; this run's threads
    assert out["cached"], out  # the child cached what it measured, under this run's key


@pytest.mark.slow  # a whole probe of this machine, ~15-30 s: `make test-slow`
def test_probe_disk_volume_reaches_the_sustained_measurement(tmp_path, monkeypatch, capsys):
    """`tightfit probe --nvme DIR --disk-volume SIZE` measures over SIZE (not the default 16 GiB, a quarter of the
    free space at most), and the profile keeps the volume the rates hold for."""
    from tightfit.cli import main
    from tightfit.planner import probe

    seen = {}

    def fake_probe_disk(folder, nbytes, sustained_bytes=0):
        seen["sustained_bytes"] = sustained_bytes
        rate = 2e9 if sustained_bytes < 128 << 20 else 1e9  # a cache in front of the disk holds 96 MiB
        return disk_probe.DiskProfile(rate, rate, "8:0", 8, 4 << 20, "python-direct", rate, sustained_bytes)

    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "probe_disk", fake_probe_disk)
    monkeypatch.setattr(probe, "measure_copies", lambda: (1e10, 1e10))
    monkeypatch.setattr(probe, "measure_adam", lambda device, **_: 1e8)
    monkeypatch.setattr(probe, "measure_mem_bw", lambda device: 1e10)
    monkeypatch.setattr(probe, "measure_matmul", lambda device, dtype: {128: 1e11})
    monkeypatch.setattr(probe, "measure_op_overhead", lambda device, dtype=None: 1e-5)
    monkeypatch.setattr(probe, "measure_engine_overhead", lambda device, tier="device", dtype=None: (5e-4, 1e-4))
    monkeypatch.setattr(probe, "measure_runtime_rss", lambda started=None: 300 << 20)
    assert main(["probe", "--nvme", str(tmp_path / "swap"), "--disk-volume", "96MiB"]) == 0
    assert seen["sustained_bytes"] == 96 << 20
    assert "over 96.0 MiB" in capsys.readouterr().out
    assert probe.load_cached().nvme_measured_bytes == 96 << 20
    # A second probe over another volume of the same disk keeps the first one's rates beside its own.
    assert main(["probe", "--nvme", str(tmp_path / "swap"), "--disk-volume", "256MiB"]) == 0
    cached = probe.load_cached()
    assert cached.nvme_measured_bytes == 256 << 20 and cached.nvme_read_bw == 1e9
    assert cached.nvme_volumes == {96 << 20: [2e9, 2e9, 2e9], 256 << 20: [1e9, 1e9, 1e9]}
