"""Training checkpoints: a folder of safetensors shards (one per unit) committed by an index, checked on load.

Why this shape (docs/CHECKPOINTS.md):
- *safetensors, no pickle*: a checkpoint from someone else cannot run code; any safetensors reader opens a shard.
- *one shard per unit, written in the background* (checkpoint_writer.py): an offloaded model's state streams out a
  unit at a time and the step after a save does not wait for the disk; peak extra disk is one checkpoint.
- *committed by an index*: `index.json` is written last, so a kill leaves the previous checkpoint intact and
  the new one either complete or a leftover removed at the next start.
- *nothing non-finite*: the writer checks every tensor before it commits; a diverged run keeps its last good one.
- *checked before use*: the index's metadata (types and ranges), every shard's header (names, dtypes, shapes,
  offsets), every tensor against the model being trained (not against the file's own claims), and the RNG states'
  sizes are checked before anything is written to a tier; each tensor's bytes against the CRC-32 in the index as
  it is read. Every failure is one line naming the file.

Tensor keys are the same for plain and offloaded runs ("model.<param>", "optim.<param>.exp_avg", ...: state_io.py),
so a checkpoint written with one placement resumes under another. Resume is bit-exact: model and optimizer
tensors, torch's RNG, the data generator's state (the data position) and the fp16 loss scaler's state are restored,
and the learning-rate schedule is a pure function of the step.
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from tightfit import __version__
from tightfit.errors import UsageError
from tightfit.models.hf_safetensors import TensorEntry, TensorReader, read_header
from tightfit.offload.tiers.nvme.safetensors_file import is_padding
from tightfit.train.health import read_record
from tightfit.train.checkpoint_writer import INDEX, CheckpointWriter, committed, prune
from tightfit.utils.safetensors_format import CODE_TO_DTYPE
from tightfit.utils.safetensors_io import tensor_bytes
from tightfit.utils import untrusted_json

FORMAT = "tightfit-checkpoint/2"
CHECKPOINT_NAME = "checkpoints"
"""The folder in --out-dir that holds the checkpoints (checkpoint_writer.py describes its layout)."""
RNG_TORCH = "rng.torch"
RNG_DATA = "rng.data"
RNG_CUDA = "rng.cuda"
RNG_GROUP = "rng"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def model_signature(named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """A short hash of parameter names and shapes, recorded for people and tools (loading checks each tensor)."""
    h = hashlib.sha256()
    for name, shape in sorted(named_shapes):
        h.update(f"{name}:{list(shape)};".encode())
    return h.hexdigest()[:16]


def group_of_key(key: str) -> str:
    """The shard a tensor key goes to when its writer does not group by unit (a gathered scale-out state): the
    parameter's module path up to its first numbered component ("blocks.3"), else "root" - the engine's default
    units for a stack of blocks."""
    name = key.split(".", 1)[1] if "." in key else key
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return "root"


# ---- opening and checking -------------------------------------------------------------------------------------

def _bad(path: Path, what: str) -> UsageError:
    return UsageError(f"--resume: {path} {what}; the checkpoint is damaged or was not written by tightfit - delete "
                      "that folder to resume from an older checkpoint, or use another --out-dir")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_scaler(path: Path, s) -> dict | None:
    if s is None:
        return None
    if (not isinstance(s, dict) or not isinstance(s.get("scale"), (int, float)) or isinstance(s.get("scale"), bool)
            or not (math.isfinite(s["scale"]) and s["scale"] > 0) or not _is_int(s.get("growth_tracker"))
            or s["growth_tracker"] < 0):
        raise _bad(path / INDEX, f"has a bad loss_scaler entry {s!r} (needs a finite scale > 0 and a growth_tracker "
                                 ">= 0)")
    return s


@dataclass
class Checkpoint:
    """An opened, checked checkpoint folder: its metadata, and its tensors read (and CRC-checked) on demand."""

    path: Path
    step: int
    config: dict
    signature: str
    shapes: dict[str, list[int]]
    dtypes: dict[str, torch.dtype]
    loss_scaler: dict | None = None
    health: dict | None = None
    """The run's loss around this step and the checkpoint's verdict (health.py); None when it has no record."""
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    crcs: dict[str, int] = field(default_factory=dict)
    _reader: TensorReader = field(default_factory=TensorReader)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; KeyError when absent (state_io decides whether that is an error, e.g. a checkpoint
        saved without optimizer moments resumes with fresh ones). UsageError when its bytes fail their CRC."""
        if name not in self.entries:
            raise KeyError(name)
        t = self._reader.read(self.entries[name])
        if zlib.crc32(tensor_bytes(t)) != self.crcs[name]:
            raise UsageError(f"--resume: {self.entries[name].file}: tensor {name!r} fails its checksum (bit rot or a "
                             "modified file); delete that checkpoint folder to resume from an older one")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):  # tightfit never commits one (divergence.py)
            raise UsageError(f"--resume: {self.entries[name].file}: tensor {name!r} holds NaN or infinite values (a "
                             "crafted or foreign file: tightfit commits only finite states); delete that checkpoint "
                             "folder to resume from an older one")
        return t

    def check_rng(self) -> None:
        """The saved RNG states are ones torch accepts, checked on scratch generators before anything is loaded (a
        state of the right size and checksum can still be invalid, and failed only after the tiers were filled)."""
        states = self.rng_states()
        try:
            torch.Generator().set_state(states[RNG_TORCH])
            torch.Generator().set_state(states[RNG_DATA])
        except RuntimeError as e:
            why = str(e).splitlines()[0]
            raise UsageError(f"--resume: {self.path}: its saved random-number state is not valid ({why}); delete "
                             "that checkpoint folder to resume from an older one") from None

    def rng_states(self) -> dict[str, torch.Tensor]:
        return {k: self.get(k) for k in (RNG_TORCH, RNG_DATA, RNG_CUDA) if k in self.entries}

    def close(self) -> None:
        self._reader.close()


def latest(out_dir: Path) -> Path | None:
    """The newest committed checkpoint folder of a run, or None. `out_dir`: the run's --out-dir, or a folder of
    checkpoints (its `checkpoints` folder)."""
    found = committed(out_dir) or committed(out_dir / CHECKPOINT_NAME)
    return found[-1][1] if found else None


def select(path: Path, step: int | None = None, flag: str = "--resume") -> Path:
    """The checkpoint folder to resume: `path` itself when it is one, else the one of `step` under it (--out-dir or
    its checkpoints folder), else the newest. One-line UsageError when there is none."""
    path = Path(path)
    if (path / INDEX).is_file():
        return path
    found = committed(path) or committed(path / CHECKPOINT_NAME)
    if not found:
        raise UsageError(f"{flag}: no checkpoint in {path} (the folder does not exist or holds no committed "
                         "checkpoint); drop --resume to start fresh")
    if not step:
        return found[-1][1]
    for s, folder in found:
        if s == step:
            return folder
    raise UsageError(f"--resume-step: {path} holds no checkpoint of step {step}; it holds step "
                     f"{', '.join(str(s) for s, _ in found)}")


def load_checkpoint(path: Path, flag: str = "--resume", step: int | None = None) -> Checkpoint:
    """Open and check a checkpoint under `path` (--out-dir, its checkpoints folder, or one step folder): the one
    of `step`, else the newest (`select`).

    Checks everything that does not need the model ([Note: what loading checks] in docs/CHECKPOINTS.md); the
    model's side is `check_compatible`. Raises a one-line UsageError naming the file."""
    folder = select(path, step, flag)
    try:
        index = untrusted_json.loads((folder / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise _bad(folder / INDEX, f"is not readable JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UsageError(f"{flag}: {folder / INDEX} is not a tightfit checkpoint index (format "
                         f"{index.get('format') if isinstance(index, dict) else None!r}, expected {FORMAT})")
    step, config, signature = index.get("step"), index.get("config"), index.get("signature", "")
    if not _is_int(step) or step < 0:
        raise _bad(folder / INDEX, f"has step {step!r} (needs an integer >= 0)")
    if not isinstance(config, dict) or not isinstance(signature, str):
        raise _bad(folder / INDEX, "has no config object or signature string")
    scaler = _check_scaler(folder, index.get("loss_scaler"))
    weight_map, tensors = index.get("weight_map"), index.get("tensors")
    if (not isinstance(weight_map, dict) or not isinstance(tensors, dict) or set(weight_map) != set(tensors)
            or not all(isinstance(v, str) for v in weight_map.values())):
        raise _bad(folder / INDEX, "has no matching weight_map and tensors objects")
    shapes, dtypes, crcs, views = {}, {}, {}, {}
    for key, info in tensors.items():
        ok = (isinstance(info, dict) and info.get("dtype") in CODE_TO_DTYPE and isinstance(info.get("shape"), list)
              and all(_is_int(s) and s >= 0 for s in info["shape"]) and _is_int(info.get("crc32"))
              and ("entry" not in info or (isinstance(info["entry"], str) and _is_int(info.get("offset"))
                                           and info["offset"] >= 0)))
        if not ok:
            raise _bad(folder / INDEX, f"has a bad entry for tensor {key!r}: {info!r}")
        shapes[key], dtypes[key], crcs[key] = info["shape"], CODE_TO_DTYPE[info["dtype"]], info["crc32"]
        if "entry" in info:
            views[key] = (info["entry"], info["offset"])
    entries = _read_shards(folder, weight_map, shapes, dtypes, views)
    _check_rng(folder, shapes, dtypes)
    return Checkpoint(path=folder, step=step, config=config, signature=signature, shapes=shapes, dtypes=dtypes,
                      loss_scaler=scaler, entries=entries, crcs=crcs, health=read_record(folder))


def _read_shards(folder: Path, weight_map: dict, shapes: dict, dtypes: dict, views: dict
                 ) -> dict[str, TensorEntry]:
    """Every shard's header (offsets checked as safetensors does), each tensor where the index says, as it says:
    a tensor of its own, or a view - a slice of a flat entry of the shard (checkpoint_swap.py) that must lie
    inside it, in its dtype. Nothing else may be in a shard but padding (safetensors_file.py)."""
    entries = {}
    for file in sorted(set(weight_map.values())):
        if not isinstance(file, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+\.safetensors", file):
            raise _bad(folder / INDEX, f"names a shard {file!r} that is not a plain file name")
        if not (folder / file).is_file():
            raise _bad(folder / file, "is missing (the index names it)")
        in_file, _ = read_header(folder / file)
        keys = {k for k, f in weight_map.items() if f == file}
        own = {k for k in keys if k not in views}
        flat = {views[k][0] for k in keys if k in views}
        unknown = set(in_file) - own - flat
        if own - set(in_file) or flat - set(in_file) or any(not is_padding(n) for n in unknown):
            extra = sorted((own | flat) ^ (set(in_file) - {n for n in unknown if is_padding(n)}))
            raise _bad(folder / file, f"does not hold what the index says (e.g. {extra[0]!r})")
        for k in keys:
            e = in_file[views[k][0] if k in views else k]
            if k in views:
                numel = math.prod(shapes[k])
                begin = e.begin + views[k][1] * e.dtype.itemsize
                if len(e.shape) != 1 or views[k][1] + numel > e.shape[0]:
                    raise _bad(folder / file, f"has no room for view {k!r} in entry {e.name!r}")
                e = TensorEntry(k, e.file, e.dtype, tuple(shapes[k]), begin, begin + numel * e.dtype.itemsize)
            if list(e.shape) != shapes[k] or e.dtype != dtypes[k]:
                raise _bad(folder / file, f"stores {k!r} as {e.dtype} {list(e.shape)}, the index says "
                                          f"{dtypes[k]} {shapes[k]}")
            entries[k] = e
        _check_views_apart(folder / file, [entries[k] for k in keys if k in views])
    return entries


def _check_views_apart(path: Path, views: list[TensorEntry]) -> None:
    """No two views of a shard share a byte: an index whose k_proj read q_proj's bytes (its checksum copied) would
    load another model's weights without a word (safetensors itself keeps whole entries apart)."""
    spans = sorted((e.begin, e.end, e.name) for e in views if e.end > e.begin)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise _bad(path, f"has views {a!r} and {b!r} sharing bytes (a crafted or corrupt index)")


def _check_rng(folder: Path, shapes: dict, dtypes: dict) -> None:
    """The RNG states are present and have the sizes this torch uses (a wrong size would fail deep in torch)."""
    want = {RNG_TORCH: list(torch.get_rng_state().shape), RNG_DATA: list(torch.Generator().get_state().shape)}
    if torch.cuda.is_available() and RNG_CUDA in shapes:
        want[RNG_CUDA] = list(torch.cuda.get_rng_state().shape)
    for key, shape in want.items():
        if key not in shapes:
            raise _bad(folder, f"has no {key} (the RNG state a bit-exact resume needs)")
        if shapes[key] != shape or dtypes[key] != torch.uint8:
            raise _bad(folder, f"has {key} of {dtypes[key]} {shapes[key]}; this torch's is uint8 {shape}")


def check_compatible(ckpt: Checkpoint, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a checkpoint whose tensors do not fit the model being trained, naming the first difference: every
    parameter's weights (fp32, its shape), each optimizer entry for a parameter of the model (moments of its shape,
    a scalar step, all three or none), nothing else. Checked against the model, not the file's own signature."""
    ours = {f"model.{n}": list(s) for n, s in named_shapes}
    for key, shape in ours.items():
        theirs = ckpt.shapes.get(key)
        if theirs != shape:
            raise UsageError(
                f"--resume: {ckpt.path} was written by a different model ({key[6:]}: checkpoint "
                f"{theirs if theirs is not None else 'absent'}, model {shape}); use the same model flags or another "
                "--out-dir")
        if ckpt.dtypes[key] != torch.float32:
            raise _bad(ckpt.path, f"stores {key} as {ckpt.dtypes[key]} (weights are float32)")
    params = {n: list(s) for n, s in named_shapes}
    rng = {RNG_TORCH, RNG_DATA, RNG_CUDA}
    for key in ckpt.shapes:
        if key in ours or key in rng:
            continue
        m = re.fullmatch(r"optim\.(.+)\.(exp_avg|exp_avg_sq|step)", key)
        if m is None or m.group(1) not in params:
            raise UsageError(f"--resume: {ckpt.path} was written by a different model (it holds {key!r}, which "
                             "this model has no place for); use the same model flags or another --out-dir")
        name, entry = m.groups()
        want = [] if entry == "step" else params[name]
        if ckpt.shapes[key] != want or ckpt.dtypes[key] != torch.float32:
            raise _bad(ckpt.path, f"stores {key} as {ckpt.dtypes[key]} {ckpt.shapes[key]}; the model needs "
                                  f"torch.float32 {want}")
        missing = [e for e in (*_MOMENTS, "step") if f"optim.{name}.{e}" not in ckpt.shapes]
        if missing:
            raise _bad(ckpt.path, f"has optimizer state for {name} without optim.{name}.{missing[0]}")


RESUME_SETTINGS = {"model": None, "data": None, "optim": None,
                   "train": ("steps", "micro_batch", "seq_len", "grad_accum", "seed", "precision")}
"""Settings whose change on --resume alters the run (schedule, data, numerics): a notice names each. The others
(intervals, --out-dir, --stop-at, memory placement, threads) are free to change."""


def changed_model(saved: dict, now: dict) -> tuple[str, object, object] | None:
    """(flag, saved, now) of the first setting that makes another model of the same shapes (the reference GPT's
    heads, the model folder, the tokenizer's ids, LoRA's alpha), or None. Resuming one with another model's weights would train
    without an error and mean nothing."""
    from tightfit.config import flag_name

    old, new = saved.get("model"), now.get("model", {})
    if not isinstance(old, dict):
        return None
    gpt = ("n_layer", "n_head", "n_embd") if new.get("model") == "gpt" else ()
    names = ("model", "tokenizer", "lora", *gpt)
    for name in names:
        if name in old and old[name] != new.get(name):
            return flag_name(name), old[name], new.get(name)
    return None


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'--lr 0.004 -> 0.001' for each setting of RESUME_SETTINGS that differs from the checkpoint's config."""
    from tightfit.config import flag_name

    out = []
    for section, names in RESUME_SETTINGS.items():
        old, new = saved.get(section), now.get(section, {})
        if not isinstance(old, dict):
            continue
        for name in names or new:
            if name in old and old[name] != new.get(name):
                out.append(f"{flag_name(name)} {old[name]!r} -> {new.get(name)!r}")
    return out


# ---- saving ---------------------------------------------------------------------------------------------------

def index_fields(*, step: int, config: dict, signature: str, loss_scaler: dict | None = None) -> dict:
    """The index's metadata ([Note: commit] in checkpoint_writer.py writes it last)."""
    return {"format": FORMAT, "step": int(step), "config": config, "signature": signature,
            "tightfit_version": __version__, "loss_scaler": loss_scaler}


def start_save(root: Path, groups: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]], *, step: int, config: dict,
               signature: str, rng: dict[str, torch.Tensor], loss_scaler: dict | None = None,
               health: dict | None = None) -> CheckpointWriter:
    """Hand every group to a background writer and return it: once this returns, the caller may change the
    model (the groups are its own copies); `wait()` on the writer gives the committed folder. The caller prunes
    older checkpoints after the commit (checkpoint_writer.prune)."""
    writer = CheckpointWriter(Path(root), step)
    try:
        for g in groups:
            if isinstance(g, tuple):
                writer.put(*g)
            else:  # a unit copied from its swap files (checkpoint_swap.py)
                writer.put_copy(g)
        writer.put(RNG_GROUP, [(k, v.detach().cpu().clone()) for k, v in rng.items()])
    except BaseException:
        writer.abort()
        raise
    writer.close(index_fields(step=step, config=config, signature=signature, loss_scaler=loss_scaler), health)
    return writer


def group_by_key(tensors: Iterable[tuple[str, torch.Tensor]]):
    """(group, items) from a flat (key, tensor) stream, consecutive keys of one group together (`group_of_key`)."""
    group, items = None, []
    for key, t in tensors:
        g = group_of_key(key)
        if items and g != group:
            yield group, items
            items = []
        group = g
        items.append((key, t))
    if items:
        yield group, items


class NonFiniteSaved(UsageError):
    """A tensor of a checkpoint being saved was non-finite: nothing was committed (`non_finite` says which)."""

    def __init__(self, non_finite, step: int, root: Path) -> None:
        super().__init__(f"training diverged: checkpoint tensor {non_finite.key} holds {non_finite.what} at step "
                         f"{step}; nothing was saved for step {step}, the previous checkpoint in {root} is kept")
        self.non_finite = non_finite


def save_checkpoint(root: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, step: int, config: dict,
                    signature: str, rng: dict[str, torch.Tensor], loss_scaler: dict | None = None,
                    keep: int = 1, health: dict | None = None) -> Path:
    """Write a checkpoint from a flat (key, tensor) stream and wait for its commit. `root`: the checkpoints folder
    (<out-dir>/checkpoints). UsageError when a tensor is non-finite or the disk fails; the previous one survives."""
    writer = start_save(Path(root), group_by_key(tensors), step=step, config=config, signature=signature, rng=rng,
                        loss_scaler=loss_scaler, health=health)
    path = writer.wait()
    if path is None:
        raise NonFiniteSaved(writer.non_finite, step, Path(root))
    prune(Path(root), keep)
    return path


def capture_rng(data_generator: torch.Generator) -> dict[str, torch.Tensor]:
    rng = {RNG_TORCH: torch.get_rng_state(), RNG_DATA: data_generator.get_state()}
    if torch.cuda.is_available():
        rng[RNG_CUDA] = torch.cuda.get_rng_state()
    return rng


def restore_rng(states: dict[str, torch.Tensor], data_generator: torch.Generator) -> None:
    torch.set_rng_state(states[RNG_TORCH])
    data_generator.set_state(states[RNG_DATA])
    if RNG_CUDA in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[RNG_CUDA])


def read_all(out_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint of a run, checked (for tests and inspection; a large model's would
    not fit in memory at once)."""
    c = load_checkpoint(Path(out_dir))
    try:
        return {k: c.get(k) for k in c.entries}
    finally:
        c.close()
