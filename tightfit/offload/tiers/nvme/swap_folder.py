"""The swap folder a run owns: `<--nvme>/tightfit-run-<pid>-<random>/`, under an exclusive lock on `--nvme`.

Why: the NVMe tier writes its swap files into a folder the user names, which may hold the user's own files
(even files named like swap files) or planted symlinks. tightfit must only ever touch what it wrote itself:
- the run locks `--nvme` (tightfit/utils/run_lock.py): a second run on the same folder is refused with one line
  naming the first one's PID;
- its swap files go into a subfolder it creates itself (mkdir is exclusive: a name that exists is never
  reused), mode 0700, and the NVMe store creates every file in it with O_EXCL | O_NOFOLLOW (nvme.py);
- at close it removes its swap files and the subfolder; nothing outside the subfolder is removed, ever;
- a run killed with -9 cannot clean up, so the next run that takes the lock (a free lock means the holder is
  dead) removes the leftovers of dead runs' subfolders and says so in its log. Only the files the dead run's
  manifest lists are removed (nvme/file.py: a name is recorded before its file is created, so every file a run
  made is listed); a subfolder without a manifest, or holding anything else, is left in place, with a notice.
- Several engines of one process (two wrapped models) share the lock: each has its own subfolder, the lock is
  taken by the first and released by the last, and leftovers are cleaned only when the lock is first taken (when
  no live subfolder of this process exists there).
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from tightfit.offload.tiers.nvme.file import MANIFEST
from tightfit.utils.run_lock import RunLock
from tightfit.utils.sizes import format_size

_HELD: dict[Path, list] = {}
"""Swap folders this process holds: resolved root -> [RunLock, number of live SwapFolders]. Guarded by _HELD_LOCK."""
_HELD_LOCK = threading.Lock()

RUN_PREFIX = "tightfit-run-"


def _listed(folder: Path) -> list[str] | None:
    """The names `folder`'s manifest lists (each with the names the store derives from it), or None when it has no
    readable manifest. A listed name that is not a plain file name of a swap file is ignored."""
    try:
        fd = os.open(folder / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            text = f.read(16 << 20).decode("utf-8", "replace")
    except OSError:
        return None
    names = []
    for name in text.splitlines():
        if name.endswith(".safetensors") and "/" not in name and "\0" not in name and not name.startswith("."):
            names += [name + suffix for suffix in ("", ".partial", ".corrupt")]
    return names


def _remove_swap_files(folder: Path) -> tuple[int, int, bool] | None:
    """Remove the files `folder`'s manifest lists (regular files only, not following symlinks), then the manifest
    and the folder if that empties it. Returns (files removed, bytes freed, folder removed); None when the folder
    has no manifest (nothing is removed: tightfit cannot tell its files from the user's)."""
    names = _listed(folder)
    if names is None:
        return None
    files = freed = 0
    for name in dict.fromkeys(names):
        try:
            st = os.stat(folder / name, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        try:
            os.unlink(folder / name)
        except FileNotFoundError:
            continue
        files += 1
        freed += st.st_size
    with os.scandir(folder) as it:
        others = [e.name for e in it if e.name != MANIFEST]
    if others:
        return files, freed, False
    (folder / MANIFEST).unlink(missing_ok=True)
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
            os.close(os.open(path / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
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
            removed = _remove_swap_files(folder)
        except OSError as e:
            lines.append(f"tightfit: could not clean the leftovers of a dead run in {folder} ({e.strerror})")
            continue
        pid = entry.name[len(RUN_PREFIX):].split("-")[0]
        if removed is None:
            lines.append(f"tightfit: left {folder} in place: it looks like a dead run's swap folder (PID {pid}) but "
                         f"has no manifest of the files tightfit wrote there; delete it yourself if it is not needed")
            continue
        files, freed, gone = removed
        what = f"{files} swap file{'s' if files != 1 else ''}, {format_size(freed)}"
        if gone:
            lines.append(f"tightfit: removed the leftovers of a dead run (PID {pid}) from --nvme: {folder} "
                         f"({what})")
        else:
            lines.append(f"tightfit: removed the swap files of a dead run (PID {pid}) from {folder} ({what}); the "
                         "folder stays: it holds files tightfit did not write")
    return lines

