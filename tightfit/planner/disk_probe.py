"""Measure a disk's raw sequential bandwidth, and the NVMe tier's bandwidth on the same disk.

Why: the NVMe tier is judged against the disk it runs on ("the tier's bandwidth is >= 85% of the raw disk
bandwidth measured in the same run"), and the planner needs the disk's speed to cost a placement. Both want the
same number: sequential O_DIRECT transfers of large blocks with several requests in flight, on a file in the
swap folder itself (a folder, not a device: the filesystem is part of what the tier pays for).

`measure_raw` uses fio when it is installed (the reference tool, libaio, iodepth = queue_depth), and otherwise a
Python loop of the same shape: `queue_depth` threads each issuing `block_bytes` pwrite/preadv calls on an O_DIRECT
descriptor into 4096-aligned memory, working through the file in order. The memory holds random bytes so a virtual
disk cannot shortcut zero blocks. The file is preallocated and written once before the timed write, which
overwrites it (as the tier rewrites its files in place), and deleted afterwards. Where the filesystem refuses
O_DIRECT the loop runs buffered and evicts the file from the page cache between writing and reading; the result's
`method` says which ran.

`measure_store` moves the same volume through an `NvmeStore` (aligned staging memory, the tier's defaults) and
times it wall-clock, submit to last completion; its timed writes overwrite a laid-out file too. Give both the
same `staging_buffer` to compare them side by side: then the only difference between the two figures is the
store's code path.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tightfit.errors import UsageError
from tightfit.offload.aligned import DIRECT_ALIGN, aligned_empty, byte_view
from tightfit.utils.sizes import format_size

_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class Bandwidth:
    """Sequential bandwidth of one measurement."""

    read_Bps: float
    write_Bps: float
    nbytes: int
    """Bytes written, then the same bytes read."""
    method: str
    """'fio', 'python-direct', 'python-buffered' (filesystem without O_DIRECT), or 'store'."""


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
    use_fio: bool = True,
    staging: torch.Tensor | None = None,
) -> Bandwidth:
    """Write then read `nbytes` sequentially in `folder` with `queue_depth` blocks of `block_bytes` in flight.

    staging: host memory the Python loop moves blocks through (see `staging_buffer`); block i uses the i-th
    block-sized slice, cycling when the volume is larger. Pass the same one to `measure_store` to compare the two.
    """
    folder = Path(folder)
    if block_bytes <= 0 or block_bytes % DIRECT_ALIGN:
        raise ValueError(f"block_bytes must be a positive multiple of {DIRECT_ALIGN}, got {block_bytes}")
    nbytes = max(block_bytes, nbytes // block_bytes * block_bytes)  # whole blocks, so every transfer is aligned
    _check_space(folder, nbytes)
    if use_fio and shutil.which("fio"):
        try:
            return _fio(folder, nbytes, block_bytes, queue_depth)
        except (subprocess.CalledProcessError, ValueError, KeyError):
            pass  # fio without libaio, or an unexpected output format: measure with the Python loop instead
    if staging is None:
        staging = staging_buffer(nbytes)
    views = _slices(staging, block_bytes)
    return _python(folder, nbytes, block_bytes, queue_depth, views)


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
            views = [byte_view(s) for t in memory for s in _slices(t, bs) if s.numel() == bs]
            if not views:
                raise ValueError(f"memory must hold at least one {bs}-byte block")
        else:
            if self.staging is None:
                self.staging = staging_buffer(min(max(rblocks, wblocks) * bs, 1 << 30))
            views = [byte_view(b) for b in _slices(self.staging, bs)]
        self._lay_out([rblocks, wblocks], views)
        half = max(1, self.queue_depth // 2)
        elapsed = _timed_threads([functools.partial(_run_blocks, self._fds[0], views, rblocks, bs, half, False),
                                  functools.partial(_run_blocks, self._fds[1], views, wblocks, bs, half, True)])
        return elapsed * (read_bytes + write_bytes) / ((rblocks + wblocks) * bs)

    def _lay_out(self, blocks: list[int], views: list[memoryview]) -> None:
        """Open the files on first use; write whatever blocks are asked for beyond those already written."""
        bs = self.block_bytes
        grow = [max(0, n - have) for n, have in zip(blocks, self._blocks)]
        _check_space(self.folder, sum(grow) * bs)
        try:
            if not self._fds:
                for path in self._paths:
                    self._fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600))
            for i, (fd, n) in enumerate(zip(self._fds, blocks)):
                if n > self._blocks[i]:
                    os.posix_fallocate(fd, 0, n * bs)
                    _run_blocks(fd, views, n, bs, self.queue_depth, write=True)
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
    threads: int = 8,
    chunk_bytes: int = 4 << 20,
    staging: torch.Tensor | None = None,
) -> Bandwidth:
    """Write then read `nbytes` through an `NvmeStore` as uint8 tensors of `tensor_bytes`, wall-clock timed.

    staging: as for `measure_raw`; tensor i moves through its i-th tensor-sized slice (cycling).
    """
    from tightfit.offload.nvme import NvmeStore  # here, so the planner's probe does not import the store

    folder = Path(folder)
    _check_space(folder, nbytes + (1 << 20))
    if staging is None:
        staging = staging_buffer(nbytes)
    tensor_bytes = max(DIRECT_ALIGN, min(tensor_bytes, staging.numel()) // DIRECT_ALIGN * DIRECT_ALIGN)
    slots = _slices(staging, tensor_bytes)
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


def staging_buffer(nbytes: int, max_bytes: int = 1 << 30) -> torch.Tensor:
    """A 4096-aligned uint8 host buffer of min(nbytes, max_bytes) random bytes for the measurements above.

    Random, so a virtual disk cannot shortcut zero or repeated blocks; written once here, so every page is
    faulted in before any timed loop. Distinct memory per block up to max_bytes: on some virtual machines DMA into
    the same few pages over and over is markedly slower, and both measurements should see the same memory.
    """
    buf = aligned_empty(max(DIRECT_ALIGN, min(nbytes, max_bytes)))
    buf.random_(0, 256)
    return buf


def _slices(staging: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Consecutive `size`-byte slices of `staging` (at least one: a short buffer gives one short slice)."""
    if staging.dtype != torch.uint8 or staging.data_ptr() % DIRECT_ALIGN:
        raise ValueError("staging must be a 4096-aligned uint8 tensor (see staging_buffer)")
    n = max(1, staging.numel() // size)
    return [staging[i * size : (i + 1) * size] for i in range(n)]


def _check_space(folder: Path, nbytes: int) -> None:
    if not folder.is_dir():
        raise UsageError(f"--nvme: {folder} is not a folder; create it or pick another path")
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise UsageError(
            f"--nvme: disk benchmark in {folder} needs {format_size(nbytes)} but {format_size(free)} is free; "
            f"free space or measure a smaller volume"
        )


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


def _python(folder: Path, nbytes: int, block_bytes: int, queue_depth: int, blocks: list[torch.Tensor]) -> Bandwidth:
    path = folder / f".tightfit-rawbench-{os.getpid()}.tmp"
    nblocks = nbytes // block_bytes
    if blocks[0].numel() < block_bytes:
        raise ValueError(f"staging buffer smaller than one block ({block_bytes} bytes)")
    views = [byte_view(b) for b in blocks]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    dfd, method = None, "python-buffered"
    try:
        os.posix_fallocate(fd, 0, nbytes)
        if _O_DIRECT:
            try:
                dfd = os.open(path, os.O_RDWR | _O_DIRECT)
                os.pwrite(dfd, views[0], 0)  # some filesystems accept the open and refuse the transfer
                method = "python-direct"
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if dfd is not None:
                    os.close(dfd)
                dfd = None
        io_fd = dfd if dfd is not None else fd
        # Lay the file out with one untimed pass, then time an overwrite: the tier rewrites its files in place, and
        # a first write into preallocated space costs extent conversions the tier pays only once (RawMixedDisk).
        _run_blocks(io_fd, views, nblocks, block_bytes, queue_depth, write=True)
        t_write = _run_blocks(io_fd, views, nblocks, block_bytes, queue_depth, write=True)
        if dfd is None:  # buffered: make the write durable, then make sure the reads come from the disk
            os.fsync(fd)
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        t_read = _run_blocks(io_fd, views, nblocks, block_bytes, queue_depth, write=False)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
        path.unlink(missing_ok=True)
    return Bandwidth(nbytes / t_read, nbytes / t_write, nbytes, method)


def _run_blocks(
    fd: int, views: list[memoryview], nblocks: int, block_bytes: int, queue_depth: int, write: bool
) -> float:
    """Seconds for `queue_depth` threads to move blocks 0..nblocks-1 in order, each taking the next free block.

    Block i moves through views[i % len(views)].
    """
    lock = threading.Lock()
    next_block = [0]

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

    return _timed_threads([worker] * queue_depth)


def _timed_threads(fns: list[Callable[[], object]]) -> float:
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
