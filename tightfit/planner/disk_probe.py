"""Measure the swap folder's disk for the planner: its bandwidth, and how the NVMe tier should drive it.

Why in the planner, not beside the tier: a disk is measured once, by `tightfit probe`, and the result is cached in
the hardware profile (hardware.py). The training path only reads the cached figures
(`offload.tiers.nvme.store.disk_tuning`); nothing here runs while a model trains. The benchmarks' references (raw
mixed reads and writes, the store's own bandwidth, fio) are in benchmarks/disk_reference.py.

What is measured, each the way the tier spends it, on a scratch file in the swap folder itself (a folder, not a
device: the filesystem is part of what the tier pays for):
- *bandwidth* (`measure_raw`): `queue_depth` threads each issuing `block_bytes` pwrite/preadv calls on an O_DIRECT
  descriptor, into 4096-aligned memory holding random bytes (a virtual disk cannot shortcut zero blocks), working
  through the file in order. The file is preallocated and laid out by one untimed pass; the timed write
  overwrites it (as the tier rewrites its files in place), then the read. Where the filesystem refuses O_DIRECT
  the loop runs buffered and evicts the file from the page cache before reading; `Bandwidth.method` says which.
- [Note: sustained bandwidth] (`measure_sustained`): the rates the planner predicts with, when the probe is given
  the swap folder.
  A training step moves tens of GiB; a short burst is absorbed by caches in front of the disk (a VM host's page
  cache, an SSD's SLC cache) that a long run overflows. On the benchmark VM a 256 MiB burst wrote at 4.8 GB/s and
  read at 3.7 GB/s; 16 GiB wrote at 1.0 GB/s and read at 2.2 GB/s, and the 1.3 B all-NVMe run (35 GiB of disk
  traffic a step) moved at about the latter.
  What the cache holds depends on the volume: the same disk moved 18 GiB at 3.0 GB/s and 48 GiB at 1.1 GB/s.
  So rates hold for swap files up to the volume they were measured over (`DiskProfile.measured_bytes`). The
  hardware profile keeps the rates of each volume measured (`tightfit probe --nvme DIR --disk-volume SIZE`); a
  plan takes those of the least volume that holds its swap, and warns when none does.
- *the largest transfer* (`max_transfer_bytes`): what the block device under the folder takes in one request
  (`/sys/block/<dev>/queue/max_sectors_kb`), at most 4 MiB: a larger request would be split by the kernel, and
  a transfer that holds the disk longer delays the urgent reads queued behind it ([Note: transfer size] in
  tightfit/offload/tiers/nvme/transfer.py). 4 MiB where no block device is known (tmpfs, overlay, network filesystems).
- *I/O threads* (`probe_disk`): the same file read at 8, 16 and 32 transfers in flight; the fewest within 10% of
  the fastest. Reads, because they are what compute waits for. Never fewer than 8: a training step has several
  entries in flight at once, and raw reads at 2-4 in flight were within 2% of 8 on the benchmark VM anyway.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import DIRECT_ALIGN, aligned_empty, byte_view
from tightfit.utils.sizes import format_size

_O_DIRECT = getattr(os, "O_DIRECT", 0)
MAX_TRANSFER = 4 << 20
"""Cap on the tier's largest transfer, and its value where the device's limit is unknown."""
THREAD_CHOICES = (8, 16, 32)
"""I/O thread counts `probe_disk` tries; the first is the default."""


@dataclass(frozen=True)
class Bandwidth:
    """Sequential bandwidth of one measurement."""

    read_Bps: float
    write_Bps: float
    nbytes: int
    """Bytes written, then the same bytes read."""
    method: str
    """'python-direct', 'python-buffered' (filesystem without O_DIRECT); the benchmarks add 'fio' and 'store'."""


@dataclass(frozen=True)
class DiskProfile:
    """What `probe_disk` found: the disk's bandwidth and the tier's tuning for it."""

    read_Bps: float
    write_Bps: float
    device: str
    """The folder's filesystem as "major:minor" (`offload.tiers.nvme.store.device_of`): the tuning applies there."""
    threads: int
    """I/O threads for the tier = transfers in flight."""
    chunk_bytes: int
    """Largest single transfer of the tier."""
    method: str
    mixed_Bps: float = 0.0
    """Bytes read + written per second with both in flight at once (0: not measured, a burst probe)."""
    measured_bytes: int = 0
    """The volume the rates were measured over: the scratch file written, then read back."""


def probe_disk(folder: str | Path, nbytes: int = 256 << 20, sustained_bytes: int = 0) -> DiskProfile:
    """Bandwidth of the disk under `folder` at 8 transfers in flight, its largest transfer, and the I/O threads
    the tier should use (see the module docstring). sustained_bytes: when > 0, the bandwidth reported is that of
    `measure_sustained` over up to this many bytes instead of the `nbytes` burst's. Leaves nothing in `folder`."""
    from tightfit.offload.tiers.nvme.store import device_of  # the tier's notion of "this folder's disk"

    folder = Path(folder)
    chunk = max_transfer_bytes(folder)
    nbytes = max(chunk, nbytes // chunk * chunk)
    check_space(folder, nbytes)
    staging = staging_buffer(nbytes)  # alive until the passes are done: the views do not hold it
    with _ScratchFile(folder, nbytes, chunk, [byte_view(b) for b in block_slices(staging, chunk)]) as f:
        write_s = f.seconds(THREAD_CHOICES[0], write=True)
        read_bps = {d: nbytes / f.seconds(d, write=False) for d in THREAD_CHOICES}
    best = max(read_bps.values())
    threads = min(d for d, bps in read_bps.items() if bps >= 0.9 * best)
    read, write, mixed, volume = read_bps[THREAD_CHOICES[0]], nbytes / write_s, 0.0, nbytes
    if sustained_bytes > 0:
        read, write, mixed, volume = measure_sustained(folder, sustained_bytes, block_bytes=chunk,
                                                       queue_depth=threads)
    return DiskProfile(read, write, device_of(folder) or "", threads, chunk, f.method, mixed, volume)


SEGMENTS = 16
"""`measure_sustained` times its volume in this many equal segments."""
WRITE_S_PER_GIB = 2.5
"""`measure_sustained`'s time limit for writing, per GiB of its volume (at least 40 s): both passes of a 16 GiB
file at 0.86 GB/s."""


def write_limit_s(volume: int) -> float:
    """`measure_sustained`'s default time limit for writing `volume` bytes twice over."""
    return max(40.0, WRITE_S_PER_GIB * volume / (1 << 30))


def measure_sustained(folder: str | Path, max_bytes: int, *, max_write_s: float | None = None,
                      block_bytes: int = 4 << 20, queue_depth: int = 8) -> tuple[float, float, float, int]:
    """(read, write, both at once) bytes/s of the disk under `folder` once the caches in front of it are full
    ([Note: sustained bandwidth]), and the bytes of the file they were measured over.

    Writes a fresh file of up to `max_bytes` twice over, in order, `SEGMENTS` segments per pass, until both passes
    are written or `max_write_s` has passed (default: `write_limit_s(max_bytes)`); the write rate is that of the
    second half of the segments written (the first half fills whatever cache absorbs writes; the second pass
    rewrites in place, as the NVMe tier does). Then reads the file back in order: the read rate. Then reads its
    first half while rewriting its second half, half the transfers in flight each way: bytes read + written per
    second, as a step moves them. O_DIRECT
    where the filesystem takes it (else buffered, synced and evicted before the read). Leaves nothing in
    `folder`."""
    folder = Path(folder)
    if max_write_s is None:
        max_write_s = write_limit_s(max_bytes)
    seg_blocks = max(1, max_bytes // SEGMENTS // block_bytes)
    seg = seg_blocks * block_bytes
    check_space(folder, seg * SEGMENTS)
    staging = staging_buffer(seg, max_bytes=min(seg, 256 << 20))
    views = [byte_view(b) for b in block_slices(staging, block_bytes)]
    with _ScratchFile(folder, seg * SEGMENTS, block_bytes, views, lay_out=False) as f:
        write_s: list[float] = []
        start = time.perf_counter()
        while len(write_s) < 2 * SEGMENTS and (time.perf_counter() - start < max_write_s or len(write_s) < 2):
            write_s.append(f.seconds(queue_depth, write=True, first=len(write_s) % SEGMENTS * seg_blocks,
                                     nblocks=seg_blocks))
        write_s[-1] += f.sync_seconds()  # buffered: the writes are done when they are durable
        written = min(len(write_s), SEGMENTS)  # segments the file holds
        read_s = f.seconds(queue_depth, write=False, nblocks=seg_blocks * written)
        half = max(1, seg_blocks * written // 2)
        each = max(1, queue_depth // 2)
        mixed_s = timed_threads([lambda: f.seconds(each, write=False, nblocks=half),
                                 lambda: f.seconds(each, write=True, first=half, nblocks=half)])
    tail = write_s[len(write_s) // 2:]
    return seg * written / read_s, seg * len(tail) / sum(tail), 2 * half * block_bytes / mixed_s, seg * written


def measure_raw_bandwidth(folder: str | Path, nbytes: int, **kwargs) -> tuple[float, float]:
    """(read bytes/s, write bytes/s) of sequential O_DIRECT transfers of `nbytes` in `folder`. See `measure_raw`."""
    bw = measure_raw(folder, nbytes, **kwargs)
    return bw.read_Bps, bw.write_Bps


def measure_raw(
    folder: str | Path,
    nbytes: int,
    *,
    block_bytes: int = 4 << 20,
    queue_depth: int = 8,
    staging: torch.Tensor | None = None,
) -> Bandwidth:
    """Write then read `nbytes` sequentially in `folder` with `queue_depth` blocks of `block_bytes` in flight.

    staging: host memory the blocks move through (see `staging_buffer`); block i uses the i-th block-sized slice,
    cycling when the volume is larger. Pass the same one to the benchmarks' `measure_store` to compare the two.
    """
    folder = Path(folder)
    if block_bytes <= 0 or block_bytes % DIRECT_ALIGN:
        raise ValueError(f"block_bytes must be a positive multiple of {DIRECT_ALIGN}, got {block_bytes}")
    nbytes = max(block_bytes, nbytes // block_bytes * block_bytes)  # whole blocks, so every transfer is aligned
    check_space(folder, nbytes)
    if staging is None:
        staging = staging_buffer(nbytes)
    blocks = block_slices(staging, block_bytes)
    if blocks[0].numel() < block_bytes:
        raise ValueError(f"staging buffer smaller than one block ({block_bytes} bytes)")
    with _ScratchFile(folder, nbytes, block_bytes, [byte_view(b) for b in blocks]) as f:
        t_write = f.seconds(queue_depth, write=True)
        t_read = f.seconds(queue_depth, write=False)
    return Bandwidth(nbytes / t_read, nbytes / t_write, nbytes, f.method)


def max_transfer_bytes(folder: str | Path, sysfs: str | Path = "/sys") -> int:
    """The largest request the block device under `folder` takes (max_sectors_kb), in whole 4096-byte blocks, at
    most `MAX_TRANSFER`; `MAX_TRANSFER` when unknown. `sysfs`: where sysfs is mounted (tests pass a fake one)."""
    from tightfit.offload.tiers.nvme.store import device_of

    dev = device_of(folder)
    if dev is None:
        return MAX_TRANSFER
    node = os.path.realpath(os.path.join(sysfs, "dev", "block", dev))
    # A partition has no queue of its own: its disk's is one folder up.
    for queue in (os.path.join(node, "queue"), os.path.join(os.path.dirname(node), "queue")):
        try:
            kib = int(Path(queue, "max_sectors_kb").read_text().strip())
        except (OSError, ValueError):
            continue
        return max(DIRECT_ALIGN, min(MAX_TRANSFER, kib * 1024 // DIRECT_ALIGN * DIRECT_ALIGN))
    return MAX_TRANSFER


def staging_buffer(nbytes: int, max_bytes: int = 1 << 30) -> torch.Tensor:
    """A 4096-aligned uint8 host buffer of min(nbytes, max_bytes) random bytes for the measurements.

    Random, so a virtual disk cannot shortcut zero or repeated blocks; written once here, so every page is
    faulted in before any timed loop. Distinct memory per block up to max_bytes: on some virtual machines DMA into
    the same few pages over and over is markedly slower, and measurements compared side by side should see the
    same memory. Drawn from a generator of its own: a plan may probe after the run has seeded torch (probe.py,
    `_operand`).
    """
    buf = aligned_empty(max(DIRECT_ALIGN, min(nbytes, max_bytes)))
    buf.random_(0, 256, generator=torch.Generator().manual_seed(0))
    return buf


class _ScratchFile:
    """A preallocated file of `nbytes` in `folder`, laid out by one untimed write pass (unless `lay_out` is False:
    the caller times its first writes itself), deleted on exit.

    Why lay out first: a first write into preallocated space converts extents (a journal update per write on
    ext4), a cost the tier pays once; its in-place rewrites are what the timed passes reproduce."""

    def __init__(self, folder: Path, nbytes: int, block_bytes: int, views: list[memoryview],
                 lay_out: bool = True) -> None:
        self.path = folder / f".tightfit-rawbench-{os.getpid()}-{id(self)}.tmp"
        self.nbytes, self.block_bytes, self.views, self.lay_out = nbytes, block_bytes, views, lay_out
        self.method = "python-buffered"
        self._fd = self._dfd = None

    def __enter__(self) -> "_ScratchFile":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
            if _O_DIRECT:
                try:
                    self._dfd = os.open(self.path, os.O_RDWR | _O_DIRECT)
                    os.pwrite(self._dfd, self.views[0], 0)  # some filesystems accept the open, refuse the transfer
                    self.method = "python-direct"
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    if self._dfd is not None:
                        os.close(self._dfd)
                    self._dfd = None
            if self.lay_out:
                self.seconds(8, write=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def seconds(self, queue_depth: int, write: bool, first: int = 0, nblocks: int | None = None) -> float:
        """Seconds for one sequential pass over the file (or over its blocks first..first+nblocks-1) with
        `queue_depth` blocks in flight."""
        fd = self._dfd if self._dfd is not None else self._fd
        if not write and self._dfd is None:  # buffered: make writes durable, then read from the disk, not the cache
            os.fsync(self._fd)
            os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)
        if nblocks is None:
            nblocks = self.nbytes // self.block_bytes
        return run_blocks(fd, self.views, nblocks, self.block_bytes, queue_depth, write, first)

    def sync_seconds(self) -> float:
        """Seconds to make buffered writes durable (0 with O_DIRECT: they already are)."""
        if self._dfd is not None:
            return 0.0
        t0 = time.perf_counter()
        os.fsync(self._fd)
        return time.perf_counter() - t0

    def __exit__(self, *exc) -> None:
        for fd in (self._fd, self._dfd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = None
        self.path.unlink(missing_ok=True)


def block_slices(staging: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive `size`-byte slices of `staging` (at least one: a short buffer gives one short slice)."""
    if staging.dtype != torch.uint8 or staging.data_ptr() % DIRECT_ALIGN:
        raise ValueError("staging must be a 4096-aligned uint8 tensor (see staging_buffer)")
    n = max(1, staging.numel() // size)
    return [staging[i * size : (i + 1) * size] for i in range(n)]


def check_space(folder: Path, nbytes: int) -> None:
    if not folder.is_dir():
        raise UsageError(f"--nvme: {folder} is not a folder; create it or pick another path")
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise UsageError(
            f"--nvme: disk benchmark in {folder} needs {format_size(nbytes)} but {format_size(free)} is free; "
            f"free space or measure a smaller volume"
        )


def run_blocks(fd: int, views: list[memoryview], nblocks: int, block_bytes: int, queue_depth: int,
               write: bool, first: int = 0) -> float:
    """Seconds for `queue_depth` threads to move blocks first..first+nblocks-1 in order, each taking the next free
    block.

    Block i moves through views[i % len(views)].
    """
    lock = threading.Lock()
    next_block = [first]
    nblocks += first

    def worker() -> None:
        while True:
            with lock:
                i = next_block[0]
                next_block[0] += 1
            if i >= nblocks:
                return
            off, done, view = i * block_bytes, 0, views[i % len(views)]
            while done < block_bytes:
                if write:
                    n = os.pwrite(fd, view[done:], off + done)
                else:
                    n = os.preadv(fd, [view[done:]], off + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short transfer in the disk benchmark")
                done += n

    return timed_threads([worker] * queue_depth)


def timed_threads(fns: list[Callable[[], object]]) -> float:
    """Run each callable on a thread of its own, all at once; seconds until the last is done. The first error
    any of them raised is raised here."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as e:  # reported on the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), name="tightfit-diskbench") for fn in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed
