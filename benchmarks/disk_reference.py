"""The benchmarks' disk references: what the NVMe tier is judged against, measured in the same folder.

Why apart from the probe (tightfit/planner/disk_probe.py): the probe measures what the planner and the tier need,
once; these are the references the benchmarks put next to the tier's figures ("the tier's bandwidth is >= 85% of
the raw disk's, measured in the same run"), and they stay out of the package.

- `measure_raw`: sequential write then read, with fio when it is installed (the reference tool, libaio, iodepth =
  queue_depth), otherwise the probe's Python O_DIRECT loop of the same shape.
- `measure_store`: the same volume through an `NvmeStore` (aligned staging memory, the tier's defaults unless
  given), wall-clock, submit to last completion; its timed writes overwrite a laid-out file too. Give it and
  `measure_raw` the same `staging_buffer`: the only difference between the two figures is then the store's path.
- `RawMixedDisk` / `measure_raw_mixed`: reads and writes issued together, as a training step issues them.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tightfit.errors import UsageError  # noqa: E402
from tightfit.offload.runtime.aligned import DIRECT_ALIGN, byte_view  # noqa: E402
from tightfit.planner import disk_probe  # noqa: E402
from tightfit.planner.disk_probe import (  # noqa: E402, F401  (re-exported for the benchmarks)
    Bandwidth,
    block_slices,
    check_space,
    run_blocks,
    staging_buffer,
    timed_threads,
)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def measure_raw(folder: str | Path, nbytes: int, *, block_bytes: int = 4 << 20, queue_depth: int = 8,
                use_fio: bool = True, staging: torch.Tensor | None = None) -> Bandwidth:
    """Write then read `nbytes` sequentially in `folder`, `queue_depth` blocks of `block_bytes` in flight: fio when
    installed and `use_fio`, else `disk_probe.measure_raw` (see there for `staging`)."""
    if use_fio and shutil.which("fio"):
        folder = Path(folder)
        nbytes = max(block_bytes, nbytes // block_bytes * block_bytes)
        check_space(folder, nbytes)
        try:
            return _fio(folder, nbytes, block_bytes, queue_depth)
        except (subprocess.CalledProcessError, ValueError, KeyError):
            pass  # fio without libaio, or an unexpected output format: measure with the Python loop instead
    return disk_probe.measure_raw(folder, nbytes, block_bytes=block_bytes, queue_depth=queue_depth, staging=staging)


def measure_raw_mixed(
    folder: str | Path,
    read_bytes: int,
    write_bytes: int,
    *,
    block_bytes: int = 4 << 20,
    queue_depth: int = 8,
    staging: torch.Tensor | None = None,
) -> float:
    """Seconds the disk takes to read `read_bytes` and write `write_bytes` at the same time; one measurement of
    a `RawMixedDisk` (see there), whose files are gone afterwards."""
    with RawMixedDisk(folder, block_bytes=block_bytes, queue_depth=queue_depth, staging=staging) as disk:
        return disk.seconds(read_bytes, write_bytes)


class RawMixedDisk:
    """Two scratch files in `folder` for timing reads and writes issued together, sequentially, with O_DIRECT,
    `queue_depth` blocks in flight in all (half per direction); Python loop, no fio.

    Why: a training step reads and writes at once, and a disk (or the kernel's I/O scheduler: mq-deadline, for
    one, favours reads) may serve a mix slower than either direction alone. This is the raw reference for that
    mix: the time the disk needs for exactly the step's bytes, with nothing else running.

    Both files are written once before any timing, and grown (written) as a larger volume is asked for: the timed
    writes overwrite blocks that hold data, as the tier's in-place writes do after its first step. On ext4 a
    first write into preallocated space also converts the extent (a journal update per write): on the benchmark
    VM that made the write half of the mix up to 1.7x slower, a reference the tier would beat without being fast.
    An object rather than a function so repeated measurements (one per training step) reuse the laid-out files.
    Close it (or use `with`) to delete them.
    """

    def __init__(self, folder: str | Path, *, block_bytes: int = 4 << 20, queue_depth: int = 8,
                 staging: torch.Tensor | None = None) -> None:
        if not _O_DIRECT:
            raise UsageError("measure_raw_mixed needs O_DIRECT, which this platform does not have")
        if block_bytes <= 0 or block_bytes % DIRECT_ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {DIRECT_ALIGN}, got {block_bytes}")
        self.folder = Path(folder)
        self.block_bytes = block_bytes
        self.queue_depth = queue_depth
        self.staging = staging
        self._paths = [self.folder / f".tightfit-mixbench-{os.getpid()}-{id(self)}-{k}.tmp" for k in ("r", "w")]
        self._fds: list[int] = []
        self._blocks = [0, 0]  # blocks laid out per file

    def seconds(self, read_bytes: int, write_bytes: int, memory: list[torch.Tensor] | None = None) -> float:
        """Seconds for `read_bytes` read and `write_bytes` written at once (whole blocks, scaled to the bytes).

        memory: 4096-aligned uint8 tensors to move the blocks through instead of the staging buffer (each gives
        the block-sized slices that fit in it; they must hold one block at least). Why: a transfer's speed depends on
        how physically scattered its buffer is ([Note: huge pages for disk buffers] in aligned.py), so a fair
        reference for the NVMe tier moves its bytes through the tier's own buffers. The caller keeps them alive and
        unused meanwhile.
        """
        rblocks = max(1, read_bytes // self.block_bytes)
        wblocks = max(1, write_bytes // self.block_bytes)
        bs = self.block_bytes
        if memory is not None:
            views = [byte_view(s) for t in memory for s in block_slices(t, bs) if s.numel() == bs]
            if not views:
                raise ValueError(f"memory must hold at least one {bs}-byte block")
        else:
            if self.staging is None:
                self.staging = staging_buffer(min(max(rblocks, wblocks) * bs, 1 << 30))
            views = [byte_view(b) for b in block_slices(self.staging, bs)]
        self._lay_out([rblocks, wblocks], views)
        half = max(1, self.queue_depth // 2)
        elapsed = timed_threads([functools.partial(run_blocks, self._fds[0], views, rblocks, bs, half, False),
                                 functools.partial(run_blocks, self._fds[1], views, wblocks, bs, half, True)])
        return elapsed * (read_bytes + write_bytes) / ((rblocks + wblocks) * bs)

    def _lay_out(self, blocks: list[int], views: list[memoryview]) -> None:
        """Open the files on first use; write whatever blocks are asked for beyond those already written."""
        bs = self.block_bytes
        grow = [max(0, n - have) for n, have in zip(blocks, self._blocks)]
        check_space(self.folder, sum(grow) * bs)
        try:
            if not self._fds:
                for path in self._paths:
                    self._fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600))
            for i, (fd, n) in enumerate(zip(self._fds, blocks)):
                if n > self._blocks[i]:
                    os.posix_fallocate(fd, 0, n * bs)
                    run_blocks(fd, views, n, bs, self.queue_depth, write=True)
                    self._blocks[i] = n
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise UsageError(f"--nvme: the filesystem of {self.folder} refuses O_DIRECT transfers; the mixed raw "
                             "measurement needs them") from None

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for path in self._paths:
            path.unlink(missing_ok=True)

    def __enter__(self) -> "RawMixedDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure_store(
    folder: str | Path,
    nbytes: int,
    *,
    tensor_bytes: int = 64 << 20,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    staging: torch.Tensor | None = None,
) -> Bandwidth:
    """Write then read `nbytes` through an `NvmeStore` as uint8 tensors of `tensor_bytes`, wall-clock timed.

    threads, chunk_bytes: the store's tuning (None: what it derives for `folder`, `nvme.disk_tuning`).
    staging: as for `measure_raw`; tensor i moves through its i-th tensor-sized slice (cycling).
    """
    from tightfit.offload.tiers.nvme.store import NvmeStore

    folder = Path(folder)
    check_space(folder, nbytes + (1 << 20))
    if staging is None:
        staging = staging_buffer(nbytes)
    tensor_bytes = max(DIRECT_ALIGN, min(tensor_bytes, staging.numel()) // DIRECT_ALIGN * DIRECT_ALIGN)
    slots = block_slices(staging, tensor_bytes)
    sizes = [min(tensor_bytes, nbytes - s) for s in range(0, nbytes, tensor_bytes)]
    bufs = [slots[i % len(slots)][:n] for i, n in enumerate(sizes)]
    with tempfile.TemporaryDirectory(dir=folder, prefix="tightfit-storebench-") as d:
        with NvmeStore(d, threads=threads, chunk_bytes=chunk_bytes) as store:
            store.create("bench", {f"t{i}": ((n,), torch.uint8) for i, n in enumerate(sizes)})
            # Lay the file out first, untimed: the timed writes then overwrite data, as the tier's do after its
            # first step and as `measure_raw` times them.
            for f in [store.write("bench", f"t{i}", b) for i, b in enumerate(bufs)]:
                f.result()
            t0 = time.perf_counter()
            for f in [store.write("bench", f"t{i}", b) for i, b in enumerate(bufs)]:
                f.result()
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            for f in [store.read("bench", f"t{i}", b) for i, b in enumerate(bufs)]:
                f.result()
            t_read = time.perf_counter() - t0
            method = "store" if store.stats()["direct_bytes"] else "store-buffered"
    total = sum(sizes)
    return Bandwidth(total / t_read, total / t_write, total, method)


def _fio(folder: Path, nbytes: int, block_bytes: int, queue_depth: int) -> Bandwidth:
    path = folder / f".tightfit-rawbench-{os.getpid()}.tmp"
    bw = {}
    try:
        for rw in ("write", "read"):  # the read pass reads the file the write pass laid out
            out = subprocess.run(
                ["fio", "--name=tightfit-raw", f"--filename={path}", f"--size={nbytes}", f"--bs={block_bytes}",
                 f"--rw={rw}", "--direct=1", "--ioengine=libaio", f"--iodepth={queue_depth}",
                 "--refill_buffers=1", "--output-format=json"],
                capture_output=True, text=True, check=True,
            ).stdout
            bw[rw] = parse_fio_bw(out, rw)
    finally:
        path.unlink(missing_ok=True)
    return Bandwidth(bw["read"], bw["write"], nbytes, "fio")


def parse_fio_bw(fio_json: str, rw: str) -> float:
    """Bytes/s of direction `rw` ('read' or 'write') summed over the jobs of a `fio --output-format=json` run."""
    start = fio_json.find("{")  # fio may print warnings before the JSON
    data = json.loads(fio_json[start:])
    return float(sum(job[rw]["bw_bytes"] for job in data["jobs"]))


def kernel_disk_stats(folder: str | Path) -> tuple[float, float] | None:
    """The kernel's counters for the block device under `folder` (/proc/diskstats): (seconds the device was busy,
    io_ticks; seconds of requests in flight summed over requests, time_in_queue), or None where there is none.

    Differences between two samples give the device's busy time over an interval and, divided, the mean number of
    requests in flight while busy: the queue depth as the disk saw it. Why the kernel's: the NVMe store counts a
    chunk as in flight until its I/O thread has the GIL again, which overstates both (by 5-18% in training,
    benchmarks/RESULTS.md), and keeping a per-depth count inside the store put that bookkeeping on the I/O path.
    """
    from tightfit.offload.tiers.nvme.store import device_of

    dev = device_of(folder)
    if dev is None:
        return None
    major, minor = (int(x) for x in dev.split(":"))
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if int(v[0]) == major and int(v[1]) == minor:
                    return int(v[12]) / 1000, int(v[13]) / 1000
    except (OSError, ValueError, IndexError):
        pass
    return None
