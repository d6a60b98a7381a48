"""The swap folder a run owns: `<--nvme>/tightfit-run-<pid>-<random>/`, under an exclusive lock on `--nvme`.

Why: the NVMe tier writes its swap files into a folder the user names, which may hold the user's own files
(even files named like swap files) or planted symlinks. tightfit must only ever touch what it wrote itself:
- the run locks `--nvme` (tightfit/utils/run_lock.py): a second run on the same folder is refused with one line
  naming the first one's PID;
- its swap files go into a subfolder it creates itself (mkdir is exclusive: a name that exists is never
  reused), mode 0700, and the NVMe store creates every file in it with O_EXCL | O_NOFOLLOW (nvme.py);
- at close it removes its swap files and the subfolder; nothing outside the subfolder is removed, ever;
- a run killed with -9 cannot clean up, so the next run that takes the lock (a free lock means the holder is
  dead) removes the leftovers of dead runs' subfolders and says so in its log. Only regular files whose names the
  NVMe store produces are removed; a subfolder holding anything else is left in place, with a notice.
- Several engines of one process (two wrapped models) share the lock: each has its own subfolder, the lock is
  taken by the first and released by the last, and leftovers are cleaned only when the lock is first taken (when
  no live subfolder of this process exists there).
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from tightfit.utils.run_lock import RunLock
from tightfit.utils.sizes import format_size

_HELD: dict[Path, list] = {}
"""Swap folders this process holds: resolved root -> [RunLock, number of live SwapFolders]. Guarded by _HELD_LOCK."""
_HELD_LOCK = threading.Lock()

RUN_PREFIX = "tightfit-run-"
SWAP_SUFFIXES = (".safetensors", ".safetensors.partial", ".safetensors.corrupt")
"""Names the NVMe store gives the files it writes (nvme.py): the only names ever removed."""


def _is_swap_file(entry: os.DirEntry) -> bool:
    return entry.name.endswith(SWAP_SUFFIXES) and entry.is_file(follow_symlinks=False)


def _remove_swap_files(folder: Path) -> tuple[int, int, bool]:
    """Remove the swap files in `folder` (not following symlinks), then the folder if that empties it.
    Returns (files removed, bytes freed, folder removed)."""
    files = freed = 0
    with os.scandir(folder) as it:
        entries = list(it)
    for entry in entries:
        if _is_swap_file(entry):
            size = entry.stat(follow_symlinks=False).st_size
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            files += 1
            freed += size
    try:
        folder.rmdir()
        return files, freed, True
    except OSError:
        return files, freed, False


@dataclass
class SwapFolder:
    """This run's subfolder of `--nvme`; `claim` it, hand `path` to the NVMe store, `release` it at the end.

    Released at the latest when it is garbage-collected or the interpreter exits (weakref.finalize): an engine
    whose construction failed after claiming it (a budget refusal, a full disk) leaves no files or lock behind."""

    root: Path
    path: Path
    lock: RunLock

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _release, self.root, self.path)

    @classmethod
    def claim(cls, root: str | Path, log=None) -> "SwapFolder":
        """Lock `root`, clean the leftovers of dead runs (reported through `log`, default: print), and create this
        run's subfolder. One-line UsageError (naming --nvme) when another run holds `root` or it is unusable."""
        root = Path(root)
        with _HELD_LOCK:
            key = root.resolve()
            held = _HELD.get(key)
            first = held is None
            if first:
                held = _HELD[key] = [RunLock.acquire(root, "--nvme"), 0]
            held[1] += 1
        lock = held[0]
        try:
            say = log or (lambda line: print(line, flush=True))
            for line in clean_leftovers(root) if first else []:
                say(line)
            while True:
                path = root / f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    os.mkdir(path, 0o700)  # exclusive: never a folder that already exists
                    break
                except FileExistsError:
                    continue
        except BaseException:
            _unhold(root)
            raise
        return cls(root, path, lock)

    def release(self) -> None:
        """Remove what is left of this run's swap files and its subfolder, then unlock `--nvme` if this was the
        process's last swap folder there. Idempotent."""
        self._finalizer()  # runs `_release` once; later calls do nothing


def _release(root: Path, path: Path) -> None:
    try:
        if path.is_dir():
            _remove_swap_files(path)
    finally:
        _unhold(root)


def _unhold(root: Path) -> None:
    """One SwapFolder of `root` fewer in this process; the last one unlocks it."""
    with _HELD_LOCK:
        key = root.resolve()
        held = _HELD[key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            held[0].release()


def clean_leftovers(root: Path) -> list[str]:
    """Under the lock of `root`: remove the swap files of dead runs' subfolders. Returns one log line per folder."""
    lines = []
    with os.scandir(root) as it:
        dead = [e for e in it if e.name.startswith(RUN_PREFIX) and e.is_dir(follow_symlinks=False)]
    for entry in sorted(dead, key=lambda e: e.name):
        folder = Path(entry.path)
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's: not ours to judge
            files, freed, gone = _remove_swap_files(folder)
        except OSError as e:
            lines.append(f"tightfit: could not clean the leftovers of a dead run in {folder} ({e.strerror})")
            continue
        pid = entry.name[len(RUN_PREFIX):].split("-")[0]
        what = f"{files} swap file{'s' if files != 1 else ''}, {format_size(freed)}"
        if gone:
            lines.append(f"tightfit: removed the leftovers of a dead run (PID {pid}) from --nvme: {folder} "
                         f"({what})")
        else:
            lines.append(f"tightfit: removed the swap files of a dead run (PID {pid}) from {folder} ({what}); the "
                         "folder stays: it holds files tightfit did not write")
    return lines

