"""One run per folder: an exclusive lock on `--out-dir` and on the `--nvme` swap folder, held while the run lives.

Why: two runs on one out-dir both "succeeded" while the second's checkpoint replaced the first's and their
metrics.jsonl lines interleaved; two runs on one swap folder could overwrite each other's swap files. The lock is
`fcntl.flock` on `<folder>/.tightfit.lock`, which the kernel drops when the holder exits in any way (kill -9
included): a lock that is free is the proof that the previous holder is dead, so whatever it left may be cleaned.
The file holds the holder's PID, which the refusal names.

Invariants:
- The lock file is opened with O_NOFOLLOW: a symlink planted at its name is refused, never followed; a hard link
  (another name for a user's file) is refused before anything is written to it.
- `release` unlinks the file while still holding the lock; `acquire` checks after locking that the name still
  points at the inode it locked, and retries if not. So a file removed by a releasing holder is never mistaken
  for a lock held by nobody.
- A folder this run created and leaves empty (only its lock was in it) is removed on release; any other folder
  stays.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from tightfit.errors import UsageError

LOCK_NAME = ".tightfit.lock"


def check_folder_path(folder: Path, flag: str) -> None:
    """UsageError naming `flag` when `folder`, or a folder it would be created in, is a file."""
    for parent in [folder, *folder.parents]:  # a file in the way gives a clearer message than ENOTDIR
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{flag}: {parent} is a file, not a folder, so {folder} cannot be created there; "
                             f"choose another {flag}")


def _make_folder(folder: Path, flag: str) -> bool:
    """Create `folder` (and parents) if missing; True when this call created it. One-line errors naming `flag`."""
    if folder.is_dir():
        return False
    check_folder_path(folder, flag)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return False
    except OSError as e:
        raise UsageError(f"{flag}: cannot create {folder} ({e.strerror}); choose a writable {flag}") from None
    return True


class RunLock:
    """An exclusive lock on a folder for this process (see the module docstring). Use `acquire`."""

    def __init__(self, folder: Path, fd: int, created: bool) -> None:
        self.folder = folder
        self._fd: int | None = fd
        self._created = created

    @classmethod
    def acquire(cls, folder: str | Path, flag: str) -> "RunLock":
        """Lock `folder` (created if missing) or raise a one-line UsageError naming `flag` (and the holder's PID
        when another run holds it)."""
        folder = Path(folder)
        created = _make_folder(folder, flag)
        path = folder / LOCK_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UsageError(f"{flag}: {path} is a symlink; tightfit does not follow it (nor remove it): "
                                     f"remove it yourself or choose another {flag}") from None
                raise UsageError(f"{flag}: cannot write in {folder} ({e.strerror}); choose a writable {flag}") \
                    from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_pid(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"{flag}: cannot lock {path} ({e.strerror}); choose a folder on a local "
                                     "filesystem") from None
                who = f"PID {holder}" if holder else "a process that has not yet written its PID"
                raise UsageError(f"{flag}: {folder} is in use by another tightfit run ({who}); wait for it to "
                                 f"finish or stop it, or choose another {flag}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and our lock: take the new one
        if os.fstat(fd).st_nlink > 1:  # another name for the same file: truncating it would change that file too
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise UsageError(f"{flag}: {path} is a hard link (the same file has another name on the disk), and the "
                             f"lock would overwrite it; remove {LOCK_NAME} or choose another {flag}")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise UsageError(f"{flag}: cannot write in {folder} ({e.strerror}); free space there or choose another "
                             f"{flag}") from None
        return cls(folder, fd, created)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and unlock (idempotent); remove the folder too if this run created it and it is
        empty."""
        if self._fd is None:
            return
        try:
            os.unlink(self.folder / LOCK_NAME)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._created:
            try:
                self.folder.rmdir()  # only when empty: anything else in it is the user's or the run's output
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
