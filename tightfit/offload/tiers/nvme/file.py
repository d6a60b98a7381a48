"""One open NVMe tier file: its layout, its two descriptors, and which of its entries a failed write left torn.

Why a file of its own: how a tier file comes to exist (preallocated under a temporary name, never through a
planted name or link) and what the store remembers about it while open (descriptors, O_DIRECT refused, entries
whose last write failed) are one concept, the file's life; how bytes move through it is nvme/transfer.py's, and
what a request is, nvme.py's.

[Note: failed writes] A request's `Future` carries its error: ENOSPC/EDQUOT a `UsageError` naming the folder,
the file, the tensor and what to do; any other failed transfer a `UsageError` naming the same and the OS error.
A write that fails may have landed part of its chunks: the tensor then holds neither its old bytes nor its new
ones, yet the file's header and size are intact, so any reader would take them for valid. So the store marks the
entry failed: every later read of it (of any range of it) fails with an error that says so (never stale or torn
bytes), until a write of the whole entry succeeds; a write of a range leaves the mark (the rest may be torn). On
`close` a file with a failed entry is deleted (renamed to `.corrupt` when it is to be kept: `keep=True` or
attached), so no swap file is left holding torn bytes. Every other tensor of the file keeps its bytes.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from tightfit.errors import UsageError
from tightfit.offload.tiers.nvme.transfer import FULL, O_DIRECT, out_of_space, pwrite_all
from tightfit.offload.tiers.nvme.safetensors_file import Entry
from tightfit.utils.sizes import format_size


@dataclass
class NvmeFile:
    """One open tier file. Its mutable fields are guarded by the store's lock (`direct` excepted: see there)."""

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
    """Cleared for good after the first EINVAL on `dfd`; later requests plan buffered transfers only. A plain
    bool written once: a request planned just before it is cleared falls back to buffered at its transfer."""
    dirty: bool = False
    """Written since the last `flush` (needs an fsync to be durable)."""
    pending: set = field(default_factory=set)
    """Request futures in flight on this file; `delete`/`create` wait for them before closing descriptors."""
    failed: dict = field(default_factory=dict)
    """Entry name -> the error of its last write, which failed ([Note: failed writes]); reads of it fail."""

    def refusal(self, name: str) -> UsageError | None:
        """The error a read of entry `name` gets instead of its bytes, or None ([Note: failed writes])."""
        failed = self.failed.get(name)
        if failed is None:
            return None
        return UsageError(
            f"--nvme: tensor {name!r} of {self.path} cannot be read: its last write failed, so it holds neither "
            f"its old nor its new values ({failed}); fix that and restart from the last checkpoint")

    def wrote(self, name: str, error: BaseException | None, whole: bool) -> None:
        """Record a finished write of entry `name` (`whole`: every byte of it) that failed with `error`, or not."""
        self.dirty = True
        if error is not None:
            self.failed[name] = error
        elif whole:
            self.failed.pop(name, None)  # every byte of the entry is new again

    def close(self) -> None:
        os.close(self.fd)
        if self.dfd is not None:
            os.close(self.dfd)

    def set_aside(self) -> None:
        """A kept file with a failed entry becomes `<name>.corrupt` ([Note: failed writes]), or goes."""
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
        except OSError:  # the disk may be what failed: then at least no valid-looking file stays
            self.path.unlink(missing_ok=True)


def open_file(path: Path, entries: dict[str, Entry], size: int, owned: bool, direct: bool) -> NvmeFile:
    """Open `path` buffered and, when `direct`, also with O_DIRECT (skipped where the filesystem refuses it)."""
    nofollow = os.O_NOFOLLOW if owned else 0  # a file it created is never reached through a link
    fd = os.open(path, os.O_RDWR | nofollow)
    dfd = None
    if direct:
        try:
            dfd = os.open(path, os.O_RDWR | O_DIRECT | nofollow)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT; anything else is real
                os.close(fd)
                raise
    return NvmeFile(path, entries, size, fd, dfd, owned, direct=dfd is not None)


MANIFEST = ".tightfit-files"
"""The file in a swap folder that lists every file the run created there, each written before the file itself:
after a kill, what it lists is what may be removed (swap_folder.py)."""


def record_created(folder: Path, name: str) -> None:
    """Add `name` to `folder`'s manifest, when the folder has one (a run's swap folder does)."""
    try:
        fd = os.open(folder / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        os.write(fd, f"{name}\n".encode())
    finally:
        os.close(fd)


def preallocate(folder: Path, path: Path, header: bytes, size: int) -> None:
    """Write `header` and reserve `size` bytes under a temporary name, then link it to `path`: valid, or not
    there. Both names are created exclusively ([Note: owned files] in nvme.py): nothing at either is overwritten.
    Both are in the folder's manifest before either exists (`record_created`).
    """
    tmp = path.with_name(path.name + ".partial")
    record_created(folder, path.name)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise UsageError(f"--nvme: {tmp} is in the way (a file or symlink tightfit did not create here); it is "
                         "left untouched: move it away or point --nvme at another folder") from None
    try:
        pwrite_all(fd, memoryview(header), 0)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve every block now: later in-place writes cannot run out
        except OSError as e:
            if e.errno in FULL:
                raise
            os.ftruncate(fd, size)  # filesystem without fallocate: sparse file, ENOSPC caught per write
    except OSError as e:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if e.errno in FULL:
            raise UsageError(out_of_space(folder, path.name, f"needs {format_size(size)}: disk full")) from None
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
        os.rename(tmp, path)  # a filesystem without hard links: checked free above, under the store's lock
    else:
        tmp.unlink()
