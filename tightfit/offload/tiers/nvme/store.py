"""The NVMe tier: tensors kept in preallocated safetensors files, rewritten in place by a pool of I/O threads.

Why this shape:
- *safetensors files*, one per group the engine chooses (typically one per unit and state), so the swap folder is
  never an opaque blob: any safetensors reader opens it, and a kept folder doubles as a checkpoint. The layout
  (safetensors_file.py) starts every tensor at a multiple of 4096 bytes so it can be moved with O_DIRECT.
- *preallocated, updated in place*: `create` reserves every block up front (posix_fallocate) and writes the header
  once; afterwards reads and writes touch only tensor bytes at known offsets. The file is complete and valid from
  the moment it appears (it is built under a temporary name and renamed: nvme/file.py), and a full disk is met at
  `create`, where it is a clean `UsageError`, rather than halfway through a training step.
- *positional I/O from a thread pool*: `threads` requests are in flight at once while Python keeps scheduling
  compute. The threads serve requests by priority class (io_queue.py): parameter fetches before optimizer loads
  before write-backs. A tensor goes as a few large transfers, through O_DIRECT where alignment allows
  (nvme/transfer.py, [Note: transfer size]).

This file is the store: files by name, requests on their entries, waiting and flushing. Its parts, each in a file
of its own: the disk's tuning (nvme/tuning.py, [Note: disk tuning]), one open file and its failed entries
(nvme/file.py, [Note: failed writes]), the transfers (nvme/transfer.py), the bandwidth counters (nvme/stats.py).
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import DIRECT_ALIGN, byte_view
from tightfit.offload.tiers.nvme.tuning import DEFAULT_TUNING, DiskTuning, device_of, disk_tuning
from tightfit.offload.tiers.nvme.io_queue import LOAD, WRITE, IoQueue
from tightfit.offload.tiers.nvme.file import NvmeFile, open_file, preallocate
from tightfit.offload.tiers.nvme.stats import IoStats
from tightfit.offload.tiers.nvme.transfer import O_DIRECT, out_of_space, plan, transfer
from tightfit.offload.tiers.nvme.safetensors_file import Entry, is_padding, plan_layout, read_layout
from tightfit.utils.sizes import format_size

__all__ = ["DEFAULT_TUNING", "SUFFIX", "DiskTuning", "NvmeStore", "device_of", "disk_tuning"]

SUFFIX = ".safetensors"


class NvmeStore:
    """A folder of safetensors files whose tensors are read and written asynchronously, in place.

    folder: the swap folder (created if missing). budget_bytes: most bytes the files this store creates may take
    (None: the disk's free space). threads: I/O threads = requests in flight. direct: use O_DIRECT where possible.
    chunk_bytes: largest single transfer (a multiple of 4096). threads and chunk_bytes: None takes what
    `disk_tuning(folder)` gives ([Note: disk tuning] in nvme/tuning.py). keep: leave the created files on `close`.
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
        self.direct = direct and O_DIRECT != 0
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._files: dict[str, NvmeFile] = {}
        # Serialises create/attach/delete, so two callers cannot both pass the budget check for the same bytes.
        self._layout_lock = threading.Lock()
        # Guards _files, _pending and the files' bookkeeping (nvme/file.py); never held while waiting on I/O.
        self._lock = threading.Lock()
        # The I/O threads: each runs one chunk (one pwrite/preadv) at a time, overlapping compute on the caller's
        # threads and each other. Live until close(), which drains them.
        self._pool = IoQueue(threads, "tightfit-nvme")
        self._pending: set[Future] = set()
        self._closed = False
        self._stats = IoStats()  # bytes and busy time per direction (`stats`), counted by the I/O threads

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
            preallocate(self.folder, path, header, size)
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

    def write(self, file: str, name: str, src: torch.Tensor, priority: int = WRITE, *,
              start: int | None = None) -> Future:
        """Copy `src` (contiguous CPU, the entry's dtype) into the file. The Future's result is None.

        `src` must not be modified until the Future is done; it is kept alive by the request until then, and not a
        moment longer (a done Future holding its tensor would keep memory alive that its owner already freed).
        priority: the request's class in the I/O queue (io_queue.py). start: the element of the entry `src[0]` goes
        to, given to write a range of the entry (e.g. the trainable prefix of a unit's params, whose frozen rest
        never changes); None: `src` is the whole entry (its size is checked). A range goes through O_DIRECT as far
        as its file offset and `src`'s address allow (transfer.plan), buffered otherwise.
        """
        return self._submit("write", file, name, src, priority, start)

    def read(self, file: str, name: str, dst: torch.Tensor, priority: int = LOAD, *,
             start: int | None = None) -> Future:
        """Copy the stored tensor (start None: `dst` has its size), or its elements [start, start + dst.numel()),
        into `dst` (contiguous CPU, same dtype). The Future's result is None."""
        return self._submit("read", file, name, dst, priority, start)

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
        """Bytes moved and busy seconds per direction, with the bandwidth they give (bytes / busy second); busy time
        counts concurrent chunks once and idle gaps not at all (nvme/stats.py says how, and what each key is)."""
        return self._stats.snapshot()

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
                f.set_aside()
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
            raise UsageError(out_of_space(self.folder, path.name,
                                          f"needs {format_size(size)} but {format_size(free)} is free"))

    def _open(self, file: str, path: Path, entries: dict[str, Entry], size: int, owned: bool) -> None:
        f = open_file(path, entries, size, owned, self.direct)
        with self._lock:
            self._files[file] = f

    def _drop(self, file: str, unlink: bool) -> None:
        self.wait(file)
        with self._lock:
            f = self._files.pop(file, None)
        if f is None:
            return
        f.close()
        if unlink:
            f.path.unlink(missing_ok=True)

    def _file(self, file: str) -> NvmeFile:
        if self._closed:
            raise RuntimeError("NvmeStore is closed")
        try:
            return self._files[file]
        except KeyError:
            raise KeyError(f"no tier file {file!r} in {self.folder}; create() or attach() it first") from None

    @staticmethod
    def _entry(f: NvmeFile, file: str, name: str) -> Entry:
        e = f.entries.get(name)
        if e is None or is_padding(name):
            raise KeyError(f"tier file {file!r} has no tensor {name!r}")
        return e

    def _submit(self, kind: str, file: str, name: str, t: torch.Tensor, priority: int, start: int | None) -> Future:
        """Start moving `t` to or from elements [start, start + t.numel()) of entry `name`, one transfer per part
        of the plan (transfer.plan) on the I/O threads; the Future completes when the last one is done."""
        f = self._file(file)
        e = self._entry(f, file, name)
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{kind} {file}/{name}: tensor must be contiguous and on the CPU")
        nbytes = t.numel() * t.element_size()
        first = (start or 0) * t.element_size()  # the range's first byte within the entry
        if t.dtype != e.dtype or (nbytes != e.nbytes if start is None else start < 0 or first + nbytes > e.nbytes):
            raise ValueError(
                f"{kind} {file}/{name}: stored as {e.dtype} {list(e.shape)}, got {t.dtype} {list(t.shape)}"
                + ("" if start is None else f" from element {start}")
            )
        whole = nbytes == e.nbytes
        req: Future = Future()
        req.set_running_or_notify_cancel()
        with self._lock:
            refused = f.refusal(name) if kind == "read" else None
        if refused is not None:  # [Note: failed writes]: torn bytes are never handed out
            req.set_exception(refused)
            return req
        if nbytes == 0:
            req.set_result(None)
            return req
        # The tensor's own bytes (aligned.byte_view); `alive` holds `t` until the last chunk is done, then lets it go.
        buf = byte_view(t)
        alive = [t]
        parts = plan(nbytes, e.offset + first, t.data_ptr(), f.direct, self.chunk_bytes)
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
                    if kind == "write":  # marked before the Future completes: a read ordered after it sees the mark
                        f.wrote(name, errors[0] if errors else None, whole)
                if errors:
                    req.set_exception(errors[0])
                else:
                    req.set_result(None)

        with self._lock:
            self._pending.add(req)
            f.pending.add(req)
        self._pool.submit_all(priority, [(transfer, (kind, f, name, e.offset + first + lo, buf[lo : lo + n], direct,
                                                     self._stats, self.folder), part_done)
                                         for lo, n, direct in parts])
        return req
