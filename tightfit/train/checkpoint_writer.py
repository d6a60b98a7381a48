"""Writing a checkpoint while training goes on, and the checkpoint folder's layout.

Why a background writer: a checkpoint of a large model is gigabytes; the step after a save should not wait for the
disk. The trainer reads each unit's state from its tiers (that must happen between two steps: the next step
changes it) and hands it over as a *group* of CPU tensors it no longer touches; a writer thread checks, checksums
and writes each group as one safetensors file while the trainer goes on. Memory is bounded: `put` blocks while the
groups queued but not yet written exceed `queue_bytes` (one group always passes), so a model larger than RAM
streams through a small window and only the tail of the writing overlaps the next step.

Layout of `<out-dir>/checkpoints/` (docs/CHECKPOINTS.md):

    step-00000010/                  a committed checkpoint: index.json and the shards it names
        index.json                  written last; its presence is the commit
        root.safetensors            one shard per unit (engine unit, or the same grouping for a plain model)
        blocks.0.safetensors
        ...
        rng.safetensors             RNG states
        health.json                 the run's loss around this step, and the checkpoint's verdict (health.py)
    .partial-step-00000020-<pid>/   being written (or left by a killed run)
    .removing-step-00000005-<pid>/  being removed (or left by a killed run)

[Note: commit] A save writes every shard into a `.partial-...` folder and fsyncs each, then `health.json`, then
`index.json` (temporary name, fsync, rename), then renames the folder to `step-NNNNNNNN` and fsyncs `checkpoints/`.
A kill at any moment leaves either the old set of committed checkpoints or the old set plus the new one: a
`step-*` folder always holds a complete index and every shard it names. Only then does the trainer remove
checkpoints (`prune`): beyond `--keep-checkpoints`, oldest first, but never the newest healthy one (health.py).

[Note: owned leftovers] Every folder a save creates holds a marker file (`OWNED`) from its first moment until its
last: a removal renames the checkpoint to `.removing-...` first, then deletes everything but the marker, then the
marker, then the (empty) folder. So a kill leaves a leftover that carries the marker or is empty, and the next
start removes exactly those (`clean_leftovers`, named in the log). A folder without the marker - one the user made,
even if named like a checkpoint or a partial save - is never removed. Extra disk at the peak: the checkpoint being
written.

[Note: nothing non-finite is saved] Every floating tensor is checked finite (`torch.aminmax`: ~7 GB/s on one core,
NaN and inf propagate into min or max) in the writer thread, where its bytes pass anyway, before the index is
written. A non-finite tensor stops the save: the partial folder is removed, the previous checkpoint stays, and the
trainer reports what diverged.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.offload.memory_model import CHECKPOINT_QUEUE
from tightfit.train.health import HEALTHY, verdict_of
from tightfit.utils.safetensors_format import DTYPE_TO_CODE
from tightfit.utils.safetensors_io import crc32_of, fsync_dir, tensor_bytes, write_shard
from tightfit.utils.sizes import format_size

INDEX = "index.json"
OWNED = ".tightfit-owned"
"""The marker of a folder a save created ([Note: owned leftovers])."""
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_PARTIAL_PREFIX = ".partial-step-"
_REMOVING_PREFIX = ".removing-step-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / INDEX).is_file() and not (p / OWNED).is_symlink():
            out.append((int(m.group(1)), p))  # a marker that is a symlink was never written by a save
    return sorted(out)


def check_step_names(root: Path, last: int | None = None) -> None:
    """Refuse, in one line naming --out-dir, a `step-NNNNNNNN` entry under `root` that is not a checkpoint (a
    symlink, a file, a folder without an index) where a save of this run may go (steps up to `last`, None: any): the
    save would replace it. Retention never sees one (`committed` skips them), so the others stay as they are."""
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        m = _STEP_RE.match(p.name)
        if not m or (last is not None and int(m.group(1)) > last):
            continue
        what = ("a symlink" if p.is_symlink() else "not a folder" if not p.is_dir() else
                f"a folder without {INDEX}" if not (p / INDEX).is_file() else None)
        if what is not None:
            raise UsageError(f"--out-dir: {p} is named like a checkpoint but is {what}; a save of this run would "
                             f"replace it: move it out of {root}")


def clean_leftovers(root: Path) -> list[str]:
    """Remove what a killed save or removal left in `root` ([Note: owned leftovers]); returns the names removed.
    Touches only `.partial-step-*` and `.removing-step-*` folders that hold the marker or are empty."""
    removed = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        if not p.name.startswith((_PARTIAL_PREFIX, _REMOVING_PREFIX)) or p.is_symlink() or not p.is_dir():
            continue
        if (p / OWNED).is_file() or not any(p.iterdir()):
            _remove_owned(p)
            removed.append(p.name)
    return removed


def _make_owned(folder: Path) -> None:
    folder.mkdir()
    fd = os.open(folder / OWNED, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.close(fd)


def _remove_owned(folder: Path) -> None:
    """Everything in `folder` but the marker, then the marker, then the folder ([Note: owned leftovers])."""
    for entry in sorted(folder.iterdir(), key=lambda e: e.name == OWNED):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    folder.rmdir()


def _remove_checkpoint(folder: Path) -> None:
    """Rename first: a kill leaves a `.removing-*` leftover, never a checkpoint with missing shards. A committed
    checkpoint of an older tightfit has no marker: it gets one before the rename."""
    fd = os.open(folder / OWNED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    os.close(fd)
    m = _STEP_RE.match(folder.name)
    gone = folder.with_name(f"{_REMOVING_PREFIX}{m.group(1) if m else folder.name}-{os.getpid()}")
    if gone.is_dir() and not gone.is_symlink():  # this process's own earlier removal of that step, interrupted
        _remove_owned(gone)
    os.replace(folder, gone)
    fsync_dir(folder.parent)
    _remove_owned(gone)


def prune(root: Path, keep: int, *, healthy=None) -> list[int]:
    """Keep the newest `keep` committed checkpoints and the newest healthy one; remove the others, oldest first.
    `healthy(folder)` tells a healthy checkpoint (default: its health.json's verdict). Returns the steps removed."""
    healthy = healthy or (lambda folder: verdict_of(folder) == HEALTHY)
    found = committed(root)
    protect = next((step for step, folder in reversed(found) if healthy(folder)), None)
    removed = []
    for step, folder in found[:max(0, len(found) - keep)]:
        if step != protect:
            _remove_checkpoint(folder)
            removed.append(step)
    return removed


def drop_newer(root: Path, resumed: int, saved: int) -> list[int]:
    """Remove the committed checkpoints after `resumed` but `saved`: a run resumed from an older checkpoint
    (--resume-step) replaces the later ones of the run it continues once it commits its own (`saved`). Returns
    the steps removed."""
    removed = []
    for s, folder in committed(root):
        if s > resumed and s != saved:
            _remove_checkpoint(folder)
            removed.append(s)
    return removed


class SwapFileGone(Exception):
    """A swap file a checkpoint copies from (checkpoint_swap.py) was removed under the run: its swap folder was
    deleted by hand. Not a disk error: freeing space would not help."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


@dataclass
class NonFinite:
    """The first tensor the writer found non-finite, and how."""

    key: str
    what: str  # "nan", "inf" or "-inf"


def non_finite_in(t: torch.Tensor) -> str | None:
    """None when every element is finite, else "nan", "inf" or "-inf" (the first that min/max show)."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    lo, hi = torch.aminmax(t.reshape(-1))
    lo, hi = float(lo), float(hi)
    if lo != lo or hi != hi:
        return "nan"
    if hi == float("inf"):
        return "inf"
    if lo == float("-inf"):
        return "-inf"
    return None


VERIFY_CHUNK = 16 << 20
"""Bytes of a copied shard read back at once by the writer thread (`_read_back`)."""


def _read_back(f, start: int, numel: int, dtype: torch.dtype) -> tuple[int, str | None]:
    """(CRC-32, `non_finite_in`'s answer) of `numel` elements of `dtype` at byte `start` of file `f`, read in
    VERIFY_CHUNK pieces: the CRC continues from piece to piece, so it equals the whole tensor's."""
    per = max(1, VERIFY_CHUNK // dtype.itemsize)
    buf = torch.empty(min(per, max(numel, 1)), dtype=dtype)
    crc, done = 0, 0
    while done < numel:
        n = min(per, numel - done)
        piece = buf[:n]
        f.seek(start + done * dtype.itemsize)
        if f.readinto(tensor_bytes(piece)) != n * dtype.itemsize:
            raise OSError(f"short read of {f.name}")
        what = non_finite_in(piece)
        if what is not None:
            return crc, what
        crc = zlib.crc32(tensor_bytes(piece), crc)
        done += n
    return crc, None


class CheckpointWriter:
    """One checkpoint being written by a background thread; see the module docstring.

    Use: `put(group, items)` per unit (blocks while the queue is full), then `close(index_fields)`; `wait()` returns
    the committed folder or raises (UsageError for a disk error; `self.non_finite` says what diverged);
    `failed()` tells without waiting. `abort()` drops everything.
    """

    def __init__(self, root: Path, step: int, *, queue_bytes: int = CHECKPOINT_QUEUE) -> None:
        self.root, self.step = root, step
        self.final = root / step_dir_name(step)
        self.partial = root / f"{_PARTIAL_PREFIX}{step:08d}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            if self.partial.is_dir() and (self.partial / OWNED).is_file():
                _remove_owned(self.partial)  # this process's own, from a save of this step that failed
            while True:  # a name nothing holds: never into a folder of someone else's
                try:
                    _make_owned(self.partial)
                    break
                except FileExistsError:
                    self.partial = root / f"{_PARTIAL_PREFIX}{step:08d}-{os.getpid()}-{secrets.token_hex(4)}"
        except OSError as e:  # a disk made read-only or full since the last save: nothing of this save exists yet
            raise self._disk_error(e) from None
        # Guards the partial folder between the trainer's file copies (`put_copy`) and its removal by the writer
        # thread when the save stops: a copy never lands in a folder being removed (it would outlive its marker).
        self._folder_lock = threading.Lock()
        self._folder_gone = False
        self.queue_bytes = queue_bytes
        self.non_finite: NonFinite | None = None
        self.error: BaseException | None = None
        self.bytes_written = 0
        self._files: set[str] = set()
        self._weight_map: dict[str, str] = {}
        self._tensors: dict[str, dict] = {}
        # Guarded by _cv: the queue of (file, items) not yet written, their bytes, and the closing fields.
        self._cv = threading.Condition()
        self._queue: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
        self._queued = 0
        self._fields: dict | None = None
        self._health: dict | None = None
        self._aborted = False
        self._done = threading.Event()
        self.result: Path | None = None
        # The writer thread: lives until the checkpoint is committed, dropped or failed; `wait()` and `abort()` join
        # it, so once either returns no thread of this save is alive (a distributed rank ends its process right
        # after its last save: [Note: leaving the process group] in tightfit/parallel/mesh.py).
        self._thread = threading.Thread(target=self._run, name="tightfit-checkpoint", daemon=True)
        self._thread.start()

    # ---- the trainer's side ------------------------------------------------------------------------------------

    def put(self, group: str, items: list[tuple[str, torch.Tensor]]) -> None:
        """Queue one group's tensors (CPU tensors the caller no longer changes) as one shard file."""
        file = self._file_name(group)
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        with self._cv:
            while self._queue and self._queued + nbytes > self.queue_bytes and not self._done.is_set():
                self._cv.wait()
            if self._done.is_set():
                return  # failed or diverged: nothing more is written; wait() reports why
            self._queue.append((file, items))
            self._queued += nbytes
            self._cv.notify_all()

    def put_copy(self, copy) -> None:
        """A unit whose states are on NVMe (checkpoint_swap.SwapCopy): its shard is copied from the swap files now,
        on the caller's thread (the copy must be of this step's state); checked and checksummed later, on the
        writer thread, from the copy."""
        file = self._file_name(copy.group)
        try:
            with self._folder_lock:
                if self._folder_gone:
                    return  # stopped (a non-finite tensor, a disk error): wait() reports why
                copy.write(self.partial / file)
        except SwapFileGone as e:
            raise UsageError(f"--nvme: the swap file {e.path} is gone (was {e.path.parent} deleted while the run "
                             f"used it?); the checkpoint of step {self.step} cannot be taken from it and the previous "
                             "one is untouched: continue from that with --resume, and leave the swap folder alone "
                             "while a run uses it") from None
        except OSError as e:
            if self.non_finite is not None or self.error is not None:
                return  # the writer stopped meanwhile and removed the folder: wait() reports why
            raise self._disk_error(e) from None
        with self._cv:
            self._queue.append((file, copy))
            self._cv.notify_all()

    def close(self, fields: dict, health: dict | None = None) -> None:
        """No more groups; commit with these index fields (and this health record: health.py) once everything
        queued is written."""
        with self._cv:
            self._health = health
            self._fields = fields
            self._cv.notify_all()

    def failed(self) -> bool:
        return self._done.is_set() and self.result is None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Path | None:
        """Block until committed (returns its folder) or stopped: re-raises a disk error; returns None when a
        non-finite tensor stopped the save (`non_finite` says which)."""
        self._done.wait()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()
        self._done.wait()
        self._thread.join()

    # ---- the writer thread -------------------------------------------------------------------------------------

    def _file_name(self, group: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", group) or "unit"
        name, i = f"{base}.safetensors", 1
        while name in self._files:  # a group seen twice (an exporter's order) gets a second file
            i += 1
            name = f"{base}-{i}.safetensors"
        self._files.add(name)
        return name

    def _next(self):
        with self._cv:
            while not self._queue and self._fields is None and not self._aborted:
                self._cv.wait()
            if self._aborted:
                return "abort"
            if self._queue:
                return self._queue[0]
            return None  # closed and drained

    def _written(self, nbytes: int) -> None:
        with self._cv:
            self._queue.pop(0)
            self._queued -= nbytes
            self._cv.notify_all()

    def _run(self) -> None:
        try:
            while True:
                job = self._next()
                if job == "abort":
                    break
                if job is None:
                    self.result = self._commit()
                    break
                file, payload = job
                if isinstance(payload, list):
                    nbytes = sum(t.numel() * t.element_size() for _, t in payload)
                    ok = self._write(file, payload)
                else:
                    nbytes, ok = 0, self._verify_copy(file, payload)
                if not ok:
                    break
                self._written(nbytes)
        except OSError as e:
            self.error = self._disk_error(e)
        except BaseException as e:  # a bug: reported by wait() with its traceback
            self.error = e
        finally:
            if self.result is None:
                with self._folder_lock:
                    self._folder_gone = True
                    with contextlib.suppress(OSError):
                        _remove_owned(self.partial)
            with self._cv:
                self._queue.clear()
                self._queued = 0
                self._done.set()
                self._cv.notify_all()

    def _disk_error(self, e: OSError) -> UsageError:
        fix = {errno.EROFS: "make the disk writable again", errno.EACCES: "give the run write permission there",
               errno.EPERM: "give the run write permission there"}.get(e.errno, "free space")
        return UsageError(f"--out-dir: cannot write the checkpoint of step {self.step} in {self.root} "
                          f"({e.strerror or e}); the previous checkpoint is untouched; {fix} and resume with "
                          "--resume")

    def _record(self, key: str, file: str, t: torch.Tensor, crc: int) -> None:
        self._record_entry(key, file, t.dtype, tuple(t.shape), t.numel(), crc)

    def _record_entry(self, key: str, file: str, dtype: torch.dtype, shape: tuple[int, ...], numel: int, crc: int,
                      view: tuple[str, int] | None = None) -> None:
        if key in self._weight_map:
            raise ValueError(f"checkpoint tensor {key!r} written twice")
        self._weight_map[key] = file
        self._tensors[key] = {"dtype": DTYPE_TO_CODE[dtype], "shape": list(shape), "crc32": crc}
        if view is not None:
            self._tensors[key].update(entry=view[0], offset=view[1])
        self.bytes_written += numel * dtype.itemsize

    def _verify_copy(self, file: str, copy) -> bool:
        """Sync a copied shard, then read it back in VERIFY_CHUNK pieces (the writer's memory stays bounded however
        large a tensor is): each tensor finite, its CRC-32, its index entry as a view."""
        from tightfit.offload.tiers.nvme.safetensors_file import read_layout

        entries, _ = read_layout(self.partial / file)
        with open(self.partial / file, "rb") as f:
            os.fsync(f.fileno())  # durable before the index can name it ([Note: commit])
            for v in copy.views:
                start = entries[v.entry].offset + v.offset * v.dtype.itemsize
                numel = 1
                for d in v.shape:
                    numel *= int(d)
                crc, what = _read_back(f, start, numel, v.dtype)
                if what is not None:
                    self.non_finite = NonFinite(v.key, what)
                    return False
                self._record_entry(v.key, file, v.dtype, v.shape, numel, crc, (v.entry, v.offset))
        for key, t in copy.small:
            what = non_finite_in(t)
            if what is not None:
                self.non_finite = NonFinite(key, what)
                return False
            self._record(key, file, t, crc32_of(t))
        return True

    def _write(self, file: str, items: list[tuple[str, torch.Tensor]]) -> bool:
        """Check, checksum and write one shard; False when a tensor is non-finite (nothing is committed)."""
        items = [(k, t.detach().cpu().contiguous()) for k, t in items]
        for key, t in items:
            what = non_finite_in(t)
            if what is not None:
                self.non_finite = NonFinite(key, what)
                return False
        crcs = write_shard(self.partial / file, items)
        for key, t in items:
            self._record(key, file, t, crcs[key])
        return True

    def _commit(self) -> Path:
        """[Note: commit]: the health record, the index, then the folder's name. Pruning is the caller's (`prune`)."""
        if self._health is not None:
            from tightfit.train.health import write_record

            write_record(self.partial, self._health)
        index = {**self._fields, "weight_map": self._weight_map, "tensors": self._tensors}
        tmp = self.partial / f".{INDEX}.tmp"
        with open(tmp, "w") as f:
            json.dump(index, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.partial / INDEX)
        fsync_dir(self.partial)
        if self.final.exists() or self.final.is_symlink():  # the same step saved again (a resumed run that
            check_step_names(self.root, self.step)  # stopped where it started); anything else is refused, kept
            _remove_checkpoint(self.final)
        os.replace(self.partial, self.final)
        fsync_dir(self.root)
        return self.final


def checkpoint_bytes(named_shapes: list[tuple[str, tuple[int, ...]]], trainable: set[str]) -> int:
    """Bytes one checkpoint of this model takes: fp32 weights, two fp32 moments and a step count per trainable
    parameter, plus what is not tensor data: RNG states and the index's fixed part (64 KiB), a shard header and
    index entry per tensor (512 bytes covers a name of ~300 characters)."""
    total = 64 << 10
    for name, shape in named_shapes:
        n = 1
        for s in shape:
            n *= int(s)
        total += 4 * n + 512
        if name in trainable:
            total += 8 * n + 4 + 3 * 512
    return total


def check_room(out_dir: Path, per_checkpoint: int, *, keep: int = 1, kept: int = 0, saves: int | None = None,
               flag: str = "--out-dir", note: str = "", reserved: int = 0, last_frees: int = 0) -> tuple[int, int]:
    """(need, free) for the checkpoints a run will write in `out_dir`; UsageError when they cannot fit. A save
    writes the new checkpoint beside the kept ones before it removes any ([Note: commit]), so the disk must take
    `keep` of them plus the one being written, less the `kept` ones already there (a resumed run's), and never
    more than the `saves` this run makes; `reserved` bytes there are spoken for (swap files not yet allocated).
    `last_frees`: bytes the run's last save needs less than a whole checkpoint, as it removes the swap files it
    takes over ([Note: the last save takes the swap's place]); counted only where `saves` is known."""
    on_disk = keep + 1 if saves is None else min(keep + 1, kept + saves)
    count = max(1, on_disk - kept)
    need = count * per_checkpoint
    if saves is not None and last_frees > 0:
        before_last = max(0, min(keep + 1, kept + saves - 1) - kept) if saves > 1 else 0
        need = max(need - min(last_frees, per_checkpoint), before_last * per_checkpoint)
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = max(0, free_bytes(probe) - reserved)  # reserved: what the run will take there before its first save
    if need > free:
        what = ("a checkpoint of this model needs" if count == 1 else
                f"{count} checkpoints of this model (--keep-checkpoints {keep}, and the next one written beside "
                f"them before the oldest goes) need")
        raise UsageError(f"{flag}: {what} {format_size(need)} but {probe} has {format_size(free)} free{note}; free "
                         f"space there, keep fewer checkpoints, or pick another {flag}")
    return need, free


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free
