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
    .partial-step-00000020-<pid>/   being written (or left by a killed run)

[Note: commit] A save writes every shard into a `.partial-...` folder and fsyncs each, then writes `index.json`
(temporary name, fsync, rename), then renames the folder to `step-NNNNNNNN` and fsyncs `checkpoints/`. A kill at any
moment leaves either the old set of committed checkpoints or the old set plus the new one: a `step-*` folder
always holds a complete index and every shard it names. Only then are checkpoints beyond `--keep-checkpoints`
removed, oldest first, index first (so a half-removed folder is a leftover, never a checkpoint). Leftovers
(`.partial-*` folders; `step-*` folders without an index) are removed at the next start, named in the log;
nothing else in the folder is touched. Extra disk at the peak: the checkpoint being written.

[Note: nothing non-finite is saved] Every floating tensor is checked finite (`torch.aminmax`: ~7 GB/s on one core,
NaN and inf propagate into min or max) in the writer thread, where its bytes pass anyway, before the index is
written. A non-finite tensor stops the save: the partial folder is removed, the previous checkpoint stays, and the
trainer reports what diverged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.utils.safetensors_format import DTYPE_TO_CODE
from tightfit.utils.safetensors_io import crc32_of, fsync_dir, tensor_bytes, write_shard
from tightfit.utils.sizes import format_size

INDEX = "index.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_PARTIAL_PREFIX = ".partial-step-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / INDEX).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def clean_leftovers(root: Path) -> list[str]:
    """Remove what a killed save left in `root` ([Note: commit]); returns the names removed. Touches only names
    tightfit writes: `.partial-step-*` folders and `step-*` folders without an index."""
    removed = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        stale = (p.name.startswith(_PARTIAL_PREFIX) or (_STEP_RE.match(p.name) and not (p / INDEX).is_file()))
        if stale and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def _remove_checkpoint(folder: Path) -> None:
    """Index first: a folder half-removed by a kill is a leftover, never a checkpoint with missing shards."""
    (folder / INDEX).unlink(missing_ok=True)
    fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints, remove the others (oldest first)."""
    found = committed(root)
    for _, folder in found[:max(0, len(found) - keep)]:
        _remove_checkpoint(folder)


@dataclass
class NonFinite:
    """The first tensor the writer found non-finite, and how."""

    key: str
    what: str  # "nan", "inf" or "-inf"


def _non_finite(t: torch.Tensor) -> str | None:
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


class CheckpointWriter:
    """One checkpoint being written by a background thread; see the module docstring.

    Use: `put(group, items)` per unit (blocks while the queue is full), then `close(index_fields)`; `wait()` returns
    the committed folder or raises (UsageError for a disk error; `self.non_finite` says what diverged);
    `failed()` tells without waiting. `abort()` drops everything.
    """

    def __init__(self, root: Path, step: int, *, keep: int, queue_bytes: int = 256 << 20) -> None:
        self.root, self.step, self.keep = root, step, keep
        self.final = root / step_dir_name(step)
        self.partial = root / f"{_PARTIAL_PREFIX}{step:08d}-{os.getpid()}"
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir()
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
        if self._done.is_set():
            return  # stopped (a non-finite tensor, a disk error): wait() reports why
        file = self._file_name(copy.group)
        try:
            copy.write(self.partial / file)
        except OSError as e:
            if self.non_finite is not None or self.error is not None:
                return  # the writer stopped meanwhile and removed the folder: wait() reports why
            raise self._disk_error(e) from None
        with self._cv:
            self._queue.append((file, copy))
            self._cv.notify_all()

    def close(self, fields: dict) -> None:
        """No more groups; commit with these index fields once everything queued is written."""
        with self._cv:
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
                shutil.rmtree(self.partial, ignore_errors=True)
            with self._cv:
                self._queue.clear()
                self._queued = 0
                self._done.set()
                self._cv.notify_all()

    def _disk_error(self, e: OSError) -> UsageError:
        return UsageError(f"--out-dir: cannot write the checkpoint of step {self.step} in {self.root} "
                          f"({e.strerror or e}); the previous checkpoint is untouched; free space and resume with "
                          "--resume")

    def _record(self, key: str, file: str, t: torch.Tensor, crc: int, view: tuple[str, int] | None = None) -> None:
        if key in self._weight_map:
            raise ValueError(f"checkpoint tensor {key!r} written twice")
        self._weight_map[key] = file
        self._tensors[key] = {"dtype": DTYPE_TO_CODE[t.dtype], "shape": list(t.shape), "crc32": crc}
        if view is not None:
            self._tensors[key].update(entry=view[0], offset=view[1])
        self.bytes_written += t.numel() * t.element_size()

    def _verify_copy(self, file: str, copy) -> bool:
        """Sync a copied shard, then read it back a tensor at a time: finite, CRC-32, index entries as views."""
        from tightfit.offload.tiers.nvme.safetensors_file import read_layout

        entries, _ = read_layout(self.partial / file)
        with open(self.partial / file, "rb") as f:
            os.fsync(f.fileno())  # durable before the index can name it ([Note: commit])
            for v in copy.views:
                t = torch.empty(v.shape, dtype=v.dtype)
                f.seek(entries[v.entry].offset + v.offset * v.dtype.itemsize)
                f.readinto(tensor_bytes(t))
                what = _non_finite(t)
                if what is not None:
                    self.non_finite = NonFinite(v.key, what)
                    return False
                self._record(v.key, file, t, crc32_of(t), (v.entry, v.offset))
        for key, t in copy.small:
            what = _non_finite(t)
            if what is not None:
                self.non_finite = NonFinite(key, what)
                return False
            self._record(key, file, t, crc32_of(t))
        return True

    def _write(self, file: str, items: list[tuple[str, torch.Tensor]]) -> bool:
        """Check, checksum and write one shard; False when a tensor is non-finite (nothing is committed)."""
        items = [(k, t.detach().cpu().contiguous()) for k, t in items]
        for key, t in items:
            what = _non_finite(t)
            if what is not None:
                self.non_finite = NonFinite(key, what)
                return False
        crcs = write_shard(self.partial / file, items)
        for key, t in items:
            self._record(key, file, t, crcs[key])
        return True

    def _commit(self) -> Path:
        """[Note: commit]: the index, then the folder's name; then the checkpoints beyond --keep-checkpoints go."""
        index = {**self._fields, "weight_map": self._weight_map, "tensors": self._tensors}
        tmp = self.partial / f".{INDEX}.tmp"
        with open(tmp, "w") as f:
            json.dump(index, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.partial / INDEX)
        fsync_dir(self.partial)
        if self.final.exists():  # the same step saved again (a resumed run that stopped where it started)
            _remove_checkpoint(self.final)
        os.replace(self.partial, self.final)
        fsync_dir(self.root)
        prune(self.root, self.keep)
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


def check_room(out_dir: Path, need: int, flag: str = "--out-dir") -> tuple[int, int]:
    """(need, free) for a checkpoint in `out_dir`; UsageError when it cannot fit. A save writes the new checkpoint
    beside the kept ones before it removes any ([Note: commit]), so it needs its full size free."""
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = free_bytes(probe)
    if need > free:
        raise UsageError(f"{flag}: a checkpoint of this model needs {format_size(need)} but {probe} has "
                         f"{format_size(free)} free; free space there or pick another {flag}")
    return need, free


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free
