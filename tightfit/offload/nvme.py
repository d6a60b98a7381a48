"""The NVMe tier: tensors kept in preallocated safetensors files, rewritten in place by a pool of I/O threads.

Why this shape:
- *safetensors files*, one per group the engine chooses (typically one per unit and state), so the swap folder is
  never an opaque blob: any safetensors reader opens it, and a kept folder doubles as a checkpoint. The layout
  (safetensors_file.py) starts every tensor at a multiple of 4096 bytes so it can be moved with O_DIRECT.
- *preallocated, updated in place*: `create` reserves every block up front (posix_fallocate) and writes the header
  once; afterwards reads and writes touch only tensor bytes at known offsets. The file is complete and valid from
  the moment it appears (it is built under a temporary name and renamed), and a full disk is met at `create`,
  where it is a clean `UsageError`, rather than halfway through a training step.
- *positional I/O from a thread pool*: `os.pwrite` / `os.preadv` release the GIL, so `threads` requests are in
  flight at once while Python keeps scheduling compute. The threads serve requests by priority class
  (io_queue.py): parameter fetches before optimizer loads before write-backs. A tensor goes as a few large
  transfers ([Note: transfer size]). The bytes go straight between the caller's tensor memory and the file: no
  intermediate copy in Python.
- *O_DIRECT where alignment allows*: when the tensor's buffer address and its file offset agree modulo 4096 (the
  engine allocates its staging buffers with `aligned_empty`), the aligned body goes through an O_DIRECT
  descriptor, which skips the page cache (no second memcpy, no write-back bursts, no cache evicting the host
  tier). Unaligned heads and tails, unaligned buffers and filesystems that refuse O_DIRECT (EINVAL) use an
  ordinary buffered descriptor on the same file. The two descriptors never share a page within one request.

[Note: transfer size] A tensor of n bytes is cut into ceil(n / chunk_bytes) equal transfers in whole 4096-byte
blocks: as few and as large as `chunk_bytes` (the largest request the disk takes, at most 4 MiB: [Note: disk
tuning]; 4 MiB on the benchmark VM) allows. The disk serves large requests better (4 MiB reads moved about 1.5x
the bytes per queue slot of 512 KiB reads), and the several entries a training step has in flight keep its queue
busy. Measured side by side on the benchmark VM with 7 MB entries (benchmarks/RESULTS.md, batch E): cutting each
entry one piece per I/O thread (>= 512 KiB, so that a lone fetch fills the queue) gave reads at 0.70-0.72 of raw
and the mixed step 0.69-0.70; 4 MiB pieces gave 0.82-0.85 and 0.78-0.79. With 50 MB entries, 4 MiB transfers
took the tier from 0.79 (512 KiB) to 0.89 of raw.

[Note: disk tuning] How many I/O threads (= transfers in flight) and how large a transfer are properties of the
disk, not choices a user should make: `tightfit probe` measures them for the swap folder's disk
(tightfit/planner/disk_probe.py) and caches them in the hardware profile; `disk_tuning(folder)` reads that cache
when it describes the folder's filesystem, else takes the defaults (8 threads, 4 MiB). Reading is cheap (a stat
and a JSON file): nothing is measured when a model is wrapped. Benchmarks and tests that need other values pass
`threads` / `chunk_bytes` to the store (`tightfit.wrap(..., disk=DiskTuning(...))` reaches it).

[Note: failed writes] A request's `Future` carries its error: ENOSPC/EDQUOT a `UsageError` naming the folder,
the file, the tensor and what to do; any other failed transfer a `UsageError` naming the same and the OS error.
A write that fails may have landed part of its chunks: the tensor then holds neither its old bytes nor its new
ones, yet the file's header and size are intact, so any reader would take them for valid. So the store marks the
entry failed: every later read of it fails with an error that says so (never stale or torn bytes), until a write
of the whole entry succeeds. On `close` a file with a failed entry is deleted (renamed to `.corrupt` when it is
to be kept: `keep=True` or attached), so no swap file is left holding torn bytes. Every other tensor of the file
keeps its bytes.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.offload.aligned import DIRECT_ALIGN, byte_view
from tightfit.offload.io_queue import LOAD, WRITE, IoQueue
from tightfit.offload.safetensors_file import Entry, is_padding, plan_layout, read_layout
from tightfit.utils import ranges
from tightfit.utils.sizes import format_size

_RANGES = {"read": "tightfit::nvme read", "write": "tightfit::nvme write"}
"""Profiler range names, built once: a transfer formats no string when nobody profiles."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): every transfer is buffered
_FULL = (errno.ENOSPC, errno.EDQUOT)
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class DiskTuning:
    """How the NVMe tier drives its disk ([Note: disk tuning]). None: what `disk_tuning` derives for the folder."""

    threads: int | None = None
    """I/O threads = transfers in flight at once."""
    chunk_bytes: int | None = None
    """Largest single transfer, a multiple of 4096 ([Note: transfer size])."""


DEFAULT_TUNING = DiskTuning(threads=8, chunk_bytes=4 << 20)
"""Where no probe measured the folder's disk: what the benchmark VM's disk was measured best with."""


def device_of(folder: str | Path) -> str | None:
    """The filesystem holding `folder` (or its nearest existing parent) as "major:minor", or None."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    return f"{os.major(dev)}:{os.minor(dev)}"


def disk_tuning(folder: str | Path) -> DiskTuning:
    """The probe's tuning for the disk of `folder` when the cached hardware profile measured that filesystem, else
    `DEFAULT_TUNING`. Cheap: no measurement ([Note: disk tuning])."""
    # The profile is the planner's (tightfit probe writes it); only its cache is read here, lazily, so the
    # engine does not load the planner unless a disk tier is built.
    from tightfit.planner.hardware import load_cached

    hw = load_cached()
    dev = device_of(folder)
    if hw is None or not dev or hw.nvme_device != dev:
        return DEFAULT_TUNING
    threads, chunk = hw.nvme_io_threads, hw.nvme_chunk_bytes
    if threads < 1 or chunk < DIRECT_ALIGN or chunk % DIRECT_ALIGN:  # a hand-edited cache: not worth an error
        return DEFAULT_TUNING
    return DiskTuning(threads=threads, chunk_bytes=chunk)


@dataclass
class _File:
    """One open tier file."""

    path: Path
    entries: dict[str, Entry]
    size: int
    fd: int
    """Buffered O_RDWR descriptor: header, unaligned heads/tails, unaligned buffers, and the O_DIRECT fallback."""
    dfd: int | None
    """O_DIRECT descriptor on the same file (None: not asked for, or refused at open). Closed with the file."""
    owned: bool
    """Created by this store: counts against the budget, deleted on close unless keep=True."""
    direct: bool = True
    """Cleared for good after the first EINVAL on `dfd`; later requests plan buffered transfers only."""
    dirty: bool = False
    """Written since the last `flush` (needs an fsync to be durable)."""
    pending: set = field(default_factory=set)
    """Request futures in flight on this file; `delete`/`create` wait for them before closing descriptors."""
    failed: dict = field(default_factory=dict)
    """Entry name -> the error of its last write, which failed ([Note: failed writes]); reads of it fail."""


class NvmeStore:
    """A folder of safetensors files whose tensors are read and written asynchronously, in place.

    folder: the swap folder (created if missing). budget_bytes: most bytes the files this store creates may take
    (None: the disk's free space). threads: I/O threads = requests in flight. direct: use O_DIRECT where possible.
    chunk_bytes: largest single transfer (a multiple of 4096). threads and chunk_bytes: None takes what
    `disk_tuning(folder)` gives ([Note: disk tuning]). keep: leave the created files on `close`.
    """

    def __init__(
        self,
        folder: str | Path,
        budget_bytes: int | None = None,
        threads: int | None = None,
        direct: bool = True,
        *,
        chunk_bytes: int | None = None,
        keep: bool = False,
    ):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--nvme: cannot create swap folder {self.folder} ({e.strerror}); pick another path")
        if not os.access(self.folder, os.W_OK):
            raise UsageError(f"--nvme: swap folder {self.folder} is not writable; pick another path")
        if threads is None or chunk_bytes is None:
            derived = disk_tuning(self.folder)
            threads = derived.threads if threads is None else threads
            chunk_bytes = derived.chunk_bytes if chunk_bytes is None else chunk_bytes
        if threads < 1:
            raise UsageError(f"DiskTuning(threads=...): must be >= 1 (I/O requests in flight), got {threads}")
        if chunk_bytes < DIRECT_ALIGN or chunk_bytes % DIRECT_ALIGN:
            raise UsageError(f"DiskTuning(chunk_bytes=...): must be a positive multiple of {DIRECT_ALIGN}, got "
                             f"{chunk_bytes}")
        self.budget_bytes = budget_bytes
        self.direct = direct and _O_DIRECT != 0
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._files: dict[str, _File] = {}
        # Serialises create/attach/delete, so two callers cannot both pass the budget check for the same bytes.
        self._layout_lock = threading.Lock()
        # Guards _files, _pending and the counters below; never held while waiting on I/O.
        self._lock = threading.Lock()
        # The I/O threads: each runs one chunk (one pwrite/preadv) at a time, overlapping compute on the caller's
        # threads and each other. Live until close(), which drains them.
        self._pool = IoQueue(threads, "tightfit-nvme")
        self._pending: set[Future] = set()
        self._closed = False
        # Bandwidth accounting (`stats`): bytes moved per direction; busy time per direction and for either (wall
        # time with >= 1 chunk in flight), and each direction's share of the latter. Updated under _lock when a
        # chunk starts or ends (`_account`).
        self._bytes = {"read": 0, "write": 0}
        self._busy = {"read": 0.0, "write": 0.0}
        self._inflight = {"read": 0, "write": 0}
        self._since = {"read": 0.0, "write": 0.0}
        self._inflight_any = 0
        self._since_any = 0.0
        self._busy_any = 0.0
        self._mark = 0.0  # the last chunk start or end: the shares are accounted up to here
        self._share = {"read": 0.0, "write": 0.0}
        self._direct_bytes = 0
        self._fallbacks = 0

    # ---- files -------------------------------------------------------------------------------------------------

    def path(self, file: str) -> Path:
        if not file or "/" in file or os.sep in file or file in (".", ".."):
            raise ValueError(f"tier file name must be a plain name, got {file!r}")
        return self.folder / (file + SUFFIX)

    def used_bytes(self) -> int:
        """Bytes of the files this store created and still holds (what the budget is checked against)."""
        with self._lock:
            return sum(f.size for f in self._files.values() if f.owned)

    def create(
        self, file: str, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], *, align: bool = True
    ) -> None:
        """Preallocate `<folder>/<file>.safetensors` holding `tensors` (all zeros), replacing the file of that name
        this store created, if any.

        [Note: owned files] The store removes and overwrites only files it created itself: a file of that name
        that it did not create (the user's, another writer's, a symlink) is refused with a UsageError and left
        untouched, and the file is built with O_EXCL | O_NOFOLLOW (never through a planted name or link).
        align=False packs tensors without padding entries (smaller header, a file for other tools); only tensors
        that happen to land on a 4096 boundary then use O_DIRECT. If the budget or the disk cannot take the file,
        a UsageError is raised before anything changes; a file being replaced counts as freed for both checks.
        """
        if self._closed:
            raise RuntimeError("NvmeStore is closed")
        path = self.path(file)
        header, entries, size = plan_layout(tensors, DIRECT_ALIGN if align else 1)
        with self._layout_lock:
            with self._lock:
                mine = file in self._files and self._files[file].owned
            if not mine and os.path.lexists(path):
                raise UsageError(f"--nvme: {path} already exists and was not written by this run; tightfit leaves "
                                 "it untouched: move it away or point --nvme at another folder")
            self._check_room(file, path, size)
            # Checks passed: the old file (ours) goes first, so its blocks are free for the new one.
            self._drop(file, unlink=mine)
            self._preallocate(path, header, size)
            self._open(file, path, entries, size, owned=True)

    def attach(self, file: str) -> list[str]:
        """Open an existing `<folder>/<file>.safetensors` (from any writer) for reads and in-place writes.

        Attached files are never deleted by the store and do not count against its budget. Returns tensor names.
        """
        path = self.path(file)
        with self._layout_lock:
            self._drop(file, unlink=False)
            entries, size = read_layout(path)
            self._open(file, path, entries, size, owned=False)
        return self.names(file)

    def names(self, file: str) -> list[str]:
        """Tensor names in `file`, in file order, padding entries left out."""
        return [n for n in self._file(file).entries if not is_padding(n)]

    def entry(self, file: str, name: str) -> Entry:
        return self._entry(self._file(file), file, name)

    def delete(self, file: str) -> None:
        """Wait for `file`'s requests, close it and remove it from the folder (attached files too)."""
        with self._layout_lock:
            self._drop(file, unlink=True)

    # ---- transfers ---------------------------------------------------------------------------------------------

    def write(self, file: str, name: str, src: torch.Tensor, priority: int = WRITE) -> Future:
        """Copy `src` (contiguous CPU, the entry's dtype and size) into the file. The Future's result is None.

        `src` must not be modified until the Future is done; it is kept alive by the request until then, and not a
        moment longer (a done Future holding its tensor would keep memory alive that its owner already freed).
        priority: the request's class in the I/O queue (io_queue.py).
        """
        return self._submit("write", file, name, src, priority)

    def read(self, file: str, name: str, dst: torch.Tensor, priority: int = LOAD) -> Future:
        """Copy the stored tensor into `dst` (contiguous CPU, same dtype and size). The Future's result is None."""
        return self._submit("read", file, name, dst, priority)

    def wait(self, file: str | None = None) -> None:
        """Block until every request in flight (on `file`, or anywhere) is done. Errors stay on their Futures."""
        with self._lock:
            if file is None:
                pending = list(self._pending)
            else:
                pending = list(self._files[file].pending) if file in self._files else []
        wait_futures(pending)

    def flush(self) -> None:
        """Wait for all requests, then fsync every file written since the last flush (durable on the disk)."""
        self.wait()
        with self._lock:
            dirty = [f for f in self._files.values() if f.dirty]
        for f in dirty:
            os.fsync(f.fd)
            f.dirty = False

    def stats(self) -> dict:
        """Bytes moved and busy seconds per direction, with the bandwidth they give (bytes / busy second).

        Busy time is wall time during which at least one chunk of that direction was executing, so concurrent
        chunks are not double-counted and idle gaps between requests are not counted. `busy_s` is the same for
        either direction (the disk was busy); `read_share_s` and `write_share_s` split it between the directions
        in proportion to the chunks each had in flight (they add up to `busy_s`): the fair time base for a
        per-direction bandwidth when reads and writes run at once. Queue depths are the kernel's to count
        (/proc/diskstats; benchmarks/disk_reference.py).
        """
        now = time.perf_counter()
        with self._lock:
            busy = {k: self._busy[k] + (now - self._since[k] if self._inflight[k] else 0.0) for k in self._busy}
            n = self._inflight_any
            share = {k: self._share[k] + ((now - self._mark) * self._inflight[k] / n if n else 0.0)
                     for k in self._share}
            out = {
                "bytes_read": self._bytes["read"],
                "bytes_written": self._bytes["write"],
                "read_busy_s": busy["read"],
                "write_busy_s": busy["write"],
                "busy_s": self._busy_any + (now - self._since_any if n else 0.0),
                "read_share_s": share["read"],
                "write_share_s": share["write"],
                "direct_bytes": self._direct_bytes,
                "buffered_bytes": self._bytes["read"] + self._bytes["write"] - self._direct_bytes,
                "direct_fallbacks": self._fallbacks,
            }
        out["read_Bps"] = out["bytes_read"] / busy["read"] if busy["read"] else 0.0
        out["write_Bps"] = out["bytes_written"] / busy["write"] if busy["write"] else 0.0
        return out

    def failed(self, file: str) -> list[str]:
        """Entries of `file` whose last write failed ([Note: failed writes]); reads of them fail."""
        with self._lock:
            return sorted(self._file(file).failed)

    def close(self) -> None:
        """Drain the I/O threads, close every file, delete the created ones unless keep=True. Idempotent.

        A file with a failed entry ([Note: failed writes]) is deleted, or renamed to `<name>.safetensors.corrupt`
        when it would be kept (keep=True, attached): none is left that a reader would take for valid."""
        if self._closed:
            return
        self.wait()
        self._pool.shutdown()
        for name in list(self._files):
            f = self._files[name]
            kept = self.keep or not f.owned
            self._drop(name, unlink=not kept)
            if kept and f.failed:
                try:
                    os.replace(f.path, f.path.with_name(f.path.name + ".corrupt"))
                except OSError:  # the disk may be what failed: then at least no valid-looking file stays
                    f.path.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------------------

    def _check_room(self, file: str, path: Path, size: int) -> None:
        """UsageError unless the budget and the disk can take `size` bytes for `file` (its old version freed)."""
        with self._lock:
            old = self._files.get(file)
        replaced = old.size if old is not None and old.owned else 0  # its share of the budget comes back
        if self.budget_bytes is not None:
            left = self.budget_bytes - (self.used_bytes() - replaced)
            if size > left:
                raise UsageError(
                    f"--nvme: swap folder {self.folder} needs {format_size(size)} more for {path.name} but its "
                    f"budget of {format_size(self.budget_bytes)} has {format_size(left)} left; "
                    f"raise the size in --nvme PATH:SIZE or place fewer states on NVMe"
                )
        free = shutil.disk_usage(self.folder).free + (path.stat().st_size if path.exists() else 0)
        if size > free:
            raise UsageError(self._full_msg(path.name, f"needs {format_size(size)} but {format_size(free)} is free"))

    def _preallocate(self, path: Path, header: bytes, size: int) -> None:
        """Write `header` and reserve `size` bytes under a temporary name, then link it to `path`: valid, or not
        there. Both names are created exclusively ([Note: owned files]): nothing at either is overwritten."""
        tmp = path.with_name(path.name + ".partial")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            raise UsageError(f"--nvme: {tmp} is in the way (a file or symlink tightfit did not create here); it is "
                             "left untouched: move it away or point --nvme at another folder") from None
        try:
            _pwrite_all(fd, memoryview(header), 0)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve every block now: later in-place writes cannot run out
            except OSError as e:
                if e.errno in _FULL:
                    raise
                os.ftruncate(fd, size)  # filesystem without fallocate: sparse file, ENOSPC caught per write
        except OSError as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if e.errno in _FULL:
                raise UsageError(self._full_msg(path.name, f"needs {format_size(size)}: disk full")) from None
            raise
        os.close(fd)
        try:
            os.link(tmp, path, follow_symlinks=False)  # fails if anything took the name meanwhile: never replaced
        except FileExistsError:
            tmp.unlink()
            raise UsageError(f"--nvme: {path} appeared while this run created it (another writer in the swap "
                             "folder?); it is left untouched: point --nvme at a folder only this run uses") from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                tmp.unlink()
                raise
            os.rename(tmp, path)  # a filesystem without hard links: checked free above, under this run's lock
        else:
            tmp.unlink()

    def _full_msg(self, name: str, what: str) -> str:
        return (
            f"--nvme: swap folder {self.folder} is out of space: {name} {what}; free space on that disk, "
            f"or point --nvme at a bigger one"
        )

    def _open(self, file: str, path: Path, entries: dict[str, Entry], size: int, owned: bool) -> None:
        nofollow = os.O_NOFOLLOW if owned else 0  # a file it created is never reached through a link
        fd = os.open(path, os.O_RDWR | nofollow)
        dfd = None
        if self.direct:
            try:
                dfd = os.open(path, os.O_RDWR | _O_DIRECT | nofollow)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT; anything else is real
                    os.close(fd)
                    raise
        with self._lock:
            self._files[file] = _File(path, entries, size, fd, dfd, owned, direct=dfd is not None)

    def _drop(self, file: str, unlink: bool) -> None:
        self.wait(file)
        with self._lock:
            f = self._files.pop(file, None)
        if f is None:
            return
        os.close(f.fd)
        if f.dfd is not None:
            os.close(f.dfd)
        if unlink:
            f.path.unlink(missing_ok=True)

    def _file(self, file: str) -> _File:
        if self._closed:
            raise RuntimeError("NvmeStore is closed")
        try:
            return self._files[file]
        except KeyError:
            raise KeyError(f"no tier file {file!r} in {self.folder}; create() or attach() it first") from None

    @staticmethod
    def _entry(f: _File, file: str, name: str) -> Entry:
        e = f.entries.get(name)
        if e is None or is_padding(name):
            raise KeyError(f"tier file {file!r} has no tensor {name!r}")
        return e

    def _submit(self, kind: str, file: str, name: str, t: torch.Tensor, priority: int) -> Future:
        f = self._file(file)
        e = self._entry(f, file, name)
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{kind} {file}/{name}: tensor must be contiguous and on the CPU")
        if t.dtype != e.dtype or t.numel() * t.element_size() != e.nbytes:
            raise ValueError(
                f"{kind} {file}/{name}: stored as {e.dtype} {list(e.shape)}, got {t.dtype} {list(t.shape)}"
            )
        req: Future = Future()
        req.set_running_or_notify_cancel()
        with self._lock:
            failed = f.failed.get(name) if kind == "read" else None
        if failed is not None:  # [Note: failed writes]: torn bytes are never handed out
            req.set_exception(UsageError(
                f"--nvme: tensor {name!r} of {f.path} cannot be read: its last write failed, so it holds neither "
                f"its old nor its new values ({failed}); fix that and restart from the last checkpoint"))
            return req
        if e.nbytes == 0:
            req.set_result(None)
            return req
        # The tensor's own bytes (aligned.byte_view); `alive` holds `t` until the last chunk is done, then lets it go.
        buf = byte_view(t)
        alive = [t]
        parts = self._plan(f, e, t.data_ptr())
        remaining = [len(parts)]
        errors: list[BaseException] = []
        req_lock = threading.Lock()

        def part_done(error: BaseException | None) -> None:
            with req_lock:
                remaining[0] -= 1
                if error is not None:
                    errors.append(error)
                last = remaining[0] == 0
            if last:  # report only once every chunk has stopped touching the caller's buffer
                alive.clear()
                with self._lock:
                    self._pending.discard(req)
                    f.pending.discard(req)
                    if kind == "write":
                        f.dirty = True
                        # Marked before the Future completes: a read ordered after this write sees the mark.
                        if errors:
                            f.failed[name] = errors[0]
                        else:
                            f.failed.pop(name, None)  # every byte of the entry is new again
                if errors:
                    req.set_exception(errors[0])
                else:
                    req.set_result(None)

        with self._lock:
            self._pending.add(req)
            f.pending.add(req)
        self._pool.submit_all(priority, [(self._io, (kind, f, name, e.offset + start, buf[start : start + n], direct),
                                          part_done) for start, n, direct in parts])
        return req

    def _plan(self, f: _File, e: Entry, addr: int) -> list[tuple[int, int, bool]]:
        """Cut one tensor into (start, length, direct) transfers of at most chunk_bytes.

        O_DIRECT is possible only where file offset and buffer address are both 4096-aligned, i.e. when they agree
        modulo 4096: then a buffered head reaches the first aligned offset, the body goes direct in whole blocks,
        and a buffered tail carries the last partial block.
        """
        n, A = e.nbytes, DIRECT_ALIGN
        head = body = 0
        if f.direct and (e.offset - addr) % A == 0:
            head = min(n, (-e.offset) % A)
            body = (n - head) // A * A
        parts: list[tuple[int, int, bool]] = []
        for lo, hi, direct in ((0, head, False), (head, head + body, True), (head + body, n, False)):
            size = self._transfer_size(hi - lo)
            parts += [(s, min(size, hi - s), direct) for s in range(lo, hi, size)]
        return parts

    def _transfer_size(self, nbytes: int) -> int:
        """Bytes per transfer for a span of `nbytes` ([Note: transfer size])."""
        pieces = max(-(-nbytes // self.chunk_bytes), 1)
        size = -(-nbytes // pieces)
        return min(self.chunk_bytes, max(DIRECT_ALIGN, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN))

    def _io(self, kind: str, f: _File, name: str, off: int, buf: memoryview, direct: bool) -> None:
        """One transfer on an I/O thread; a profiler range "tightfit::nvme read|write <tensor>" while `--profile`
        records (tightfit/utils/ranges.py), nothing otherwise."""
        with ranges.span(_RANGES[kind], name):
            self._transfer(kind, f, name, off, buf, direct)

    def _transfer(self, kind: str, f: _File, name: str, off: int, buf: memoryview, direct: bool) -> None:
        """Run one transfer on an I/O thread (the GIL is released inside pwrite/preadv)."""
        with self._lock:
            self._account(time.perf_counter(), kind, +1)
        done, moved_direct = 0, 0
        try:
            if direct and f.direct and f.dfd is not None:
                try:
                    done = moved_direct = _transfer_once(kind, f.dfd, buf, off)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # The filesystem refused O_DIRECT after all (e.g. tmpfs, some network filesystems): stop
                    # planning direct transfers for this file and finish this one buffered.
                    with self._lock:
                        f.direct = False
                        self._fallbacks += 1
            while done < len(buf):  # buffered path; also finishes a short direct transfer
                done += _transfer_once(kind, f.fd, buf[done:], off + done)
        except OSError as e:
            if e.errno in _FULL:
                raise UsageError(
                    self._full_msg(f.path.name, f"could not take tensor {name!r} ({os.strerror(e.errno)})")
                ) from None
            raise UsageError(
                f"--nvme: {'writing' if kind == 'write' else 'reading'} tensor {name!r} of {f.path} failed at byte "
                f"{off + done} ({e.strerror or e}); check the disk under {self.folder} (dmesg), or point --nvme "
                f"at another disk") from e
        finally:
            with self._lock:
                self._account(time.perf_counter(), kind, -1)
                self._bytes[kind] += done
                self._direct_bytes += moved_direct

    def _account(self, now: float, kind: str, delta: int) -> None:
        """Under _lock: account busy time and each direction's share of it up to `now`, then change the number of
        `kind` chunks in flight by `delta` (+1 at a chunk's start, -1 at its end)."""
        n = self._inflight_any
        if n:
            for k in self._share:
                self._share[k] += (now - self._mark) * self._inflight[k] / n
        else:
            self._since_any = now
        self._mark = now
        if not self._inflight[kind]:
            self._since[kind] = now
        self._inflight[kind] += delta
        self._inflight_any += delta
        if not self._inflight[kind]:
            self._busy[kind] += now - self._since[kind]
        if not self._inflight_any:
            self._busy_any += now - self._since_any


def _transfer_once(kind: str, fd: int, buf: memoryview, off: int) -> int:
    """One pwrite or preadv call; bytes moved (> 0). Reading past the end of the file is an error."""
    if kind == "write":
        n = os.pwrite(fd, buf, off)
        if n <= 0:
            raise OSError(errno.ENOSPC, "pwrite wrote nothing")
    else:
        n = os.preadv(fd, [buf], off)
        if n <= 0:
            raise OSError(errno.EIO, "unexpected end of file (was the tier file truncated?)")
    return n


def _pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    done = 0
    while done < len(buf):
        done += _transfer_once("write", fd, buf[done:], off + done)
