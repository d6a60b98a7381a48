"""Every path a run will write, checked before the first step: a run must not train for hours and then fail to save.

Why: paths were checked at first use. `--out-dir D` whose `D/checkpoints` was a file trained 30 steps and then died
on a `FileExistsError` traceback at the first save (with the default `--save-interval 0`, the whole run lost); an
`--export-hf` into a file's subfolder or a read-only mount failed after training; `--profile FILE`, `--trace FILE`,
a `metrics.jsonl` that was a folder or a `tensorboard` that was a file gave tracebacks; a `metrics.jsonl` that was a
symlink had the metrics appended to whatever it pointed to (issue 27). Here each output path is checked the way it
will be used (a folder to create or fill, a file to create or append to), in one line naming its flag:
- nothing on the way is a file where a folder must be, or a folder where a file must be;
- nothing tightfit writes is a symlink (it would write outside the folder it was given), nor a file it appends to
  a hard link (the same write would change the other name's file);
- the nearest existing folder is writable (a read-only mount, a folder of another user);
- the path can be printed and logged: a name that is not valid UTF-8 is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from tightfit.errors import UsageError
from tightfit.utils.run_lock import check_folder_path


def _printable(path: Path, flag: str) -> None:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{flag}: {os.fsencode(path)!r} is not a valid UTF-8 name; rename it or choose another "
                         "path") from None


def _no_symlink(path: Path, flag: str) -> None:
    if path.is_symlink():
        raise UsageError(f"{flag}: {path} is a symbolic link (to {os.readlink(path)}); tightfit writes only into "
                         "what it was given: remove the link or choose another path")


def _writable_from(path: Path, flag: str) -> None:
    """The nearest existing folder at or above `path` must be a folder tightfit may write in."""
    check_folder_path(path, flag)  # no file on the way
    for parent in [path, *path.parents]:
        if parent.exists():
            if not os.access(parent, os.W_OK | os.X_OK):
                read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
                why = "Read-only file system" if read_only else "Permission denied"
                raise UsageError(f"{flag}: cannot write in {parent} ({why}), so {path} cannot be written; choose "
                                 f"a writable {flag}")
            return


ROOM_BELOW = 128
"""Bytes of the longest path tightfit writes below a folder it is given (a checkpoint's shard in the folder of a
save being removed: checkpoints/.removing-step-00000001-abc123/blocks.12.safetensors.tmp, with room to spare)."""


def _short_enough(path: Path, flag: str) -> None:
    """Every name of `path` within NAME_MAX, and `path` short enough for what is written below it (PATH_MAX):
    otherwise a save would fail hours in, with ENAMETOOLONG."""
    full = os.fsencode(os.path.abspath(path))
    existing = Path("/")
    for p in path.parents:  # the nearest folder that exists: its filesystem's limits
        try:
            if p.exists():
                existing = p
                break
        except OSError:  # a name over the limit: exists() raises ENAMETOOLONG
            continue
    name_max = os.pathconf(existing, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    path_max = os.pathconf(existing, "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    for part in Path(os.fsdecode(full)).parts:
        if len(os.fsencode(part)) > name_max:
            raise UsageError(f"{flag}: the name {part[:40]}... in it is {len(os.fsencode(part))} bytes, more than the "
                             f"{name_max} a file name may have here; choose a shorter {flag}")
    if len(full) + ROOM_BELOW > path_max:
        raise UsageError(f"{flag}: the path is {len(full)} bytes, and the files tightfit writes below it would pass "
                         f"this system's {path_max}-byte limit on a path (PATH_MAX); choose a shorter {flag}")


def check_folder(path: Path, flag: str) -> None:
    """`path` is a folder tightfit will create (if missing) and write files into."""
    _printable(path, flag)
    _short_enough(path, flag)
    _no_symlink(path, flag)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag}: {path} is a file, not a folder; choose another {flag}")
    _writable_from(path, flag)


def check_file(path: Path, flag: str) -> None:
    """`path` is a file tightfit will create (if missing) or append to."""
    _printable(path, flag)
    _no_symlink(path, flag)
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag}: {path} exists and is not a file (a folder, or a device or pipe); move it away or "
                         f"choose another {flag}")
    if path.is_file() and path.stat().st_nlink > 1:
        raise UsageError(hard_link_message(path, flag))
    _writable_from(path.parent, flag)


def hard_link_message(path: Path, flag: str) -> str:
    """A file tightfit appends to that has another name on the disk: writing it would write the other file too."""
    return (f"{flag}: {path} is a hard link (the same file has another name on the disk), and appending to it would "
            f"change that file too; remove {path.name} or choose another {flag}")


def check_outputs(cfg) -> None:
    """Raise a UsageError naming the flag of the first output path of this run that could not be written."""
    t = cfg.train
    if not str(t.out_dir).strip():
        raise UsageError("--out-dir: empty; name the folder for checkpoints and metrics (default runs/default)")
    out = Path(t.out_dir)
    check_folder(out, "--out-dir")
    from tightfit.train.checkpoint import CHECKPOINT_NAME
    from tightfit.train.tensorboard import FOLDER as TENSORBOARD

    if t.keep_checkpoints:
        check_folder(out / CHECKPOINT_NAME, f"--out-dir ({CHECKPOINT_NAME}/)")
        from tightfit.train.checkpoint_writer import check_step_names

        check_step_names(out / CHECKPOINT_NAME, t.steps)  # nothing named like a step a save of this run may take
    check_file(out / "metrics.jsonl", "--out-dir (metrics.jsonl)")
    if t.tensorboard != "off":
        check_folder(out / TENSORBOARD, f"--out-dir ({TENSORBOARD}/)")
    if t.plot:
        check_file(out / "run.png", "--plot (run.png in --out-dir)")
    if cfg.memory.nvme:
        from tightfit.config import parse_nvme

        swap = Path(parse_nvme(cfg.memory.nvme)[0])
        if swap.resolve() == out.resolve():  # both lock their folder: the run would refuse itself by its own PID
            raise UsageError(f"--nvme: {swap} is the --out-dir too; give the swap files a folder of their own "
                             f"(e.g. --nvme {out / 'swap'})")
    if t.export_hf:
        check_folder(Path(t.export_hf), "--export-hf")
    if t.profile:
        check_folder(Path(t.profile), "--profile")
    if cfg.memory.trace:
        check_folder(Path(cfg.memory.trace), "--trace")
