"""Load a local Hugging Face checkpoint folder without ever holding the model twice, or at all.

Why: the models people bring are often larger than host memory. `from_pretrained` materialises the whole model
on the host; here the model is built on the meta device (shapes only, no bytes), the checkpoint's headers are
checked against it before any data is read, and then the weights arrive one unit at a time (a transformer block,
then the leftovers), each tensor read straight from disk into the tensor that keeps it (hf_safetensors.py). After
each unit, `on_unit` may move it away before the next arrives, so host memory holds one unit plus what the caller
keeps; hf_wrap.py uses the same `UnitStreamer` to feed the offload engine's tiers, so the model never exists in
host memory at all.

The folder layout is the one `save_pretrained` writes: `config.json`, and either `model.safetensors` or shards
`model-0000x-of-0000y.safetensors` listed in `model.safetensors.index.json`. Pickle checkpoints (`*.bin`, `*.pt`)
are refused, never opened: unpickling runs arbitrary code.

Names: the checkpoint's tensor names are the model's `state_dict` names. Tied parameters (GPT-2's and often
Llama's `lm_head.weight`, which *is* the input embedding) are one tensor stored once; every name of the tie gets
the same materialised Parameter, so the tie survives loading. Checkpoints saved from the base model (names
without the `model.` / `transformer.` prefix, as in the original GPT-2 release) are accepted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.models.hf_safetensors import TensorEntry, TensorReader, read_header
from tightfit.models.hf_units import slot_units
from tightfit.utils import untrusted_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _require_transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise UsageError("Hugging Face models need transformers: pip install 'tightfit[hf]'") from None
    return transformers


@dataclass
class HFCheckpoint:
    """A validated local checkpoint folder: its config and, per tensor name, where the bytes are."""

    folder: Path
    config: object
    """The transformers `PretrainedConfig` read from config.json."""
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    """Checkpoint tensor name -> file and byte range. Empty for a config-only folder."""

    @property
    def has_weights(self) -> bool:
        return bool(self.entries)

    @classmethod
    def open(cls, path: str | Path) -> "HFCheckpoint":
        """Read config.json and every shard's header; raises UsageError naming the file on any problem."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UsageError(f"{folder}: not a folder; give a local Hugging Face model folder (config.json + "
                             "model.safetensors)")
        if not (folder / "config.json").is_file():
            raise UsageError(f"{folder}: no config.json; a Hugging Face model folder needs one (save it with "
                             "model.config.save_pretrained(folder))")
        transformers = _require_transformers()
        try:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers and huggingface_hub raise many kinds for a bad file
            # (ValueError, OSError, KeyError, and a strict-dataclass error for a field of the wrong type)
            first = " ".join(line.strip() for line in str(e).strip().splitlines()[:2]) or type(e).__name__
            raise UsageError(f"{folder / 'config.json'}: transformers cannot read it ({first}); fix that field or "
                             "re-save the config with model.config.save_pretrained(folder)") from None
        return cls(folder, config, _weight_entries(folder))


def _weight_entries(folder: Path) -> dict[str, TensorEntry]:
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = untrusted_json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{index}: not a valid index (expected JSON with a 'weight_map' object)") from None
        entries = {}
        for shard in sorted(set(weight_map.values())):
            file = folder / shard
            if not file.is_file():
                names = [n for n, s in weight_map.items() if s == shard]
                raise UsageError(f"{file}: shard listed in {INDEX_NAME} (for {len(names)} tensors, e.g. {names[0]!r}) "
                                 "does not exist; copy the complete checkpoint folder")
            in_file, _ = read_header(file)
            for name in (n for n, s in weight_map.items() if s == shard):
                if name not in in_file:
                    raise UsageError(f"{file}: {INDEX_NAME} says it holds tensor {name!r}, but it does not; the "
                                     "index and shards come from different exports")
                entries[name] = in_file[name]
        return entries
    if (folder / SINGLE_NAME).is_file():
        entries = read_header(folder / SINGLE_NAME)[0]
        if not entries:  # it would train from random weights, and say nothing (issue 27)
            raise UsageError(f"{folder / SINGLE_NAME}: holds no tensor; copy the weights again, or remove the file to "
                             "train from config.json's random initialisation on purpose")
        return entries
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    if shards:
        raise UsageError(f"{folder}: has sharded weights ({shards[0].name}, ...) but no {INDEX_NAME}; copy the index "
                         "file too")
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:  # weights under another name: training them from a random init without a word would be worse
        raise UsageError(f"{folder}: has {others[0]}{' and more' if len(others) > 1 else ''} but no {SINGLE_NAME} or "
                         f"{INDEX_NAME}; rename the weights file to {SINGLE_NAME} (or write an index for shards)")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise UsageError(f"{folder}: weights only as pickle ({pickles[0]}); tightfit never loads pickles (unpickling "
                         "runs arbitrary code). Convert them once, where you trust the file, with "
                         "save_pretrained(folder, safe_serialization=True) or safetensors' convert script")
    return {}


def build_meta_model(config) -> nn.Module:
    """The causal-LM model for `config` with every parameter on the meta device (no memory, no init cost).

    Non-persistent buffers (rotary `inv_freq`) are not in checkpoints, so they are computed here, for real, by the
    model's own `_init_weights` on the modules that own them, as `from_pretrained` does.
    """
    transformers = _require_transformers()
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise UsageError(f"config.json: transformers has no causal-LM model for it ({str(e).splitlines()[0]})") from None
    for module in model.modules():
        names = [n for n, b in module.named_buffers(recurse=False)
                 if b is not None and b.is_meta and n in module._non_persistent_buffers_set]
        if names:
            for n in names:
                b = module._buffers[n]
                module._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
            with torch.no_grad():
                model._init_weights(module)
    return model


@dataclass
class _Slot:
    """One tensor the model holds (a parameter or a persistent buffer), with every name it is reachable by."""

    names: list[str]
    """Its state_dict names; more than one when tied (e.g. ["model.embed_tokens.weight", "lm_head.weight"])."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype the model was built with (what a missing non-float tensor is created as)."""
    is_param: bool
    requires_grad: bool
    entry: TensorEntry | None = None
    """Where the checkpoint stores it; None when it is missing."""


def model_slots(model: nn.Module) -> list[_Slot]:
    """Every parameter and persistent buffer once, tied names grouped, in registration order."""
    by_id: dict[int, _Slot] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        s = by_id.setdefault(id(p), _Slot([], tuple(p.shape), p.dtype, True, p.requires_grad))
        s.names.append(name)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for n, b in module.named_buffers(recurse=False):
            if b is not None and n not in module._non_persistent_buffers_set:
                s = by_id.setdefault(id(b), _Slot([], tuple(b.shape), b.dtype, False, False))
                s.names.append(f"{mod_name}.{n}" if mod_name else n)
    return list(by_id.values())


def _match(slots: list[_Slot], ckpt: HFCheckpoint, prefix: str) -> set[str]:
    """Attach each slot's checkpoint entry; returns the checkpoint names used. Raises on shape mismatches."""
    used = set()
    for s in slots:
        for name in s.names:
            alt = name[len(prefix):] if prefix and name.startswith(prefix) else None
            key = name if name in ckpt.entries else alt if alt in ckpt.entries else None
            if key is None:
                continue
            used.add(key)
            if s.entry is None:
                s.entry = ckpt.entries[key]
        e = s.entry
        if e is not None and e.shape != s.shape:
            raise UsageError(f"{e.file}: tensor {e.name!r} has shape {list(e.shape)} but the model built from "
                             f"config.json expects {list(s.shape)}; the weights and config.json do not match")
        if e is not None and s.dtype.is_floating_point and not e.dtype.is_floating_point:
            raise UsageError(f"{e.file}: tensor {e.name!r} is stored as {str(e.dtype).replace('torch.', '')}, the "
                             "model's is a floating-point weight; the weights and config.json do not match")
    return used


def _set(model: nn.Module, slot: _Slot, value: torch.Tensor) -> None:
    """Install `value` under every name of the slot (so ties stay ties)."""
    new = nn.Parameter(value, requires_grad=slot.requires_grad) if slot.is_param else value
    for name in slot.names:
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        (module._parameters if slot.is_param else module._buffers)[attr] = new


def _modules_to_init(model: nn.Module, missing: list[_Slot]) -> list[nn.Module]:
    """Modules whose `_init_weights` gives the `missing` tensors of one unit their model-defined initial values.

    That is every module whose tensors are all missing (so a parent's special init, like GPT-2's scaled residual
    projections, applies too), plus each direct owner of a missing tensor; children before parents, as
    transformers' own `initialize_weights` runs. No module with a tensor outside `missing` qualifies except a
    direct owner, whose loaded tensors are replaced right after, so nothing loaded or handed away is touched.
    """
    if not missing:
        return []
    ids = {id(model.get_parameter(s.names[0]) if s.is_param else model.get_buffer(s.names[0])) for s in missing}
    owners = {id(model.get_submodule(s.names[0].rpartition(".")[0])) for s in missing}
    chosen = []
    for _, module in reversed(list(model.named_modules())):
        tensors = {id(t) for t in (*module.parameters(), *module.buffers()) if t is not None}
        if id(module) in owners or (tensors and tensors <= ids):
            chosen.append(module)
    return chosen


@dataclass
class LoadReport:
    """What loading found besides the tensors it loaded."""

    missing: list[str] = field(default_factory=list)
    """Model tensors the checkpoint lacks (randomly initialised when strict=False)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors the model has no place for (ignored)."""


class UnitStreamer:
    """Materialises a meta model's tensors from a checkpoint one unit at a time, and turns them back into meta.

    Why a class: the plain loader pushes units in order (`stream_into`), while the offload engine pulls values
    tensor by tensor as it fills each unit's tiers (hf_wrap.py); both need the same matching, checks, tie
    handling and missing-tensor init, done once here. Every check (missing tensors, shapes) runs in the
    constructor, before the first byte is read, so a bad checkpoint fails fast and leaves nothing half-loaded.
    """

    def __init__(self, model: nn.Module, ckpt: HFCheckpoint, *, dtype: torch.dtype = torch.float32,
                 strict: bool = True, units=None) -> None:
        self.model, self.ckpt, self.dtype = model, ckpt, dtype
        slots = model_slots(model)
        prefix = getattr(model, "base_model_prefix", "")
        used = _match(slots, ckpt, prefix + "." if prefix else "")
        self.report = LoadReport(missing=[s.names[0] for s in slots if s.entry is None],
                                 unexpected=sorted(set(ckpt.entries) - used))
        if self.report.missing and strict:
            raise UsageError(f"{ckpt.folder}: checkpoint lacks {len(self.report.missing)} tensors the model needs, "
                             f"e.g. {self.report.missing[:3]}; pass strict=False to initialise them randomly")
        if self.report.unexpected:
            warnings.warn(f"{ckpt.folder}: ignoring {len(self.report.unexpected)} checkpoint tensors the model has "
                          f"no place for, e.g. {self.report.unexpected[:3]}", stacklevel=3)
        slot_of = {s.names[0]: s for s in slots}
        self.groups: dict[str, list[_Slot]] = {
            unit: [slot_of[n] for n in names]
            for unit, names in slot_units(model, [s.names[0] for s in slots], units).items()}
        self.unit_of = {n: unit for unit, group in self.groups.items() for s in group for n in s.names}
        """Every state_dict name (tied aliases included) -> its unit."""
        self.reader = TensorReader()  # one plain handle per shard; closed by close()

    def __enter__(self) -> "UnitStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.reader.close()

    def load(self, unit: str, *, buffers_only: bool = False) -> list[str]:
        """Materialise every tensor of `unit` on the CPU; returns their state_dict names (aliases included).

        buffers_only: only its persistent buffers (what an engine that takes over the parameters still needs).
        """
        group = [s for s in self.groups[unit] if not (buffers_only and s.is_param)]
        missing = [s for s in group if s.entry is None]
        for s in missing:  # placeholders, filled by the model's own init just below
            _set(self.model, s, torch.empty(s.shape, dtype=self.dtype if s.dtype.is_floating_point else s.dtype))
        for module in _modules_to_init(self.model, missing):
            with torch.no_grad():
                self.model._init_weights(module)
        for s in group:
            if s.entry is not None:
                want = self.dtype if s.entry.dtype.is_floating_point else None
                _set(self.model, s, self.reader.read(s.entry, want))
        return [n for s in group for n in s.names]

    def release(self, unit: str) -> None:
        """Turn `unit`'s tensors back into meta tensors, freeing their memory."""
        for s in self.groups[unit]:
            _set(self.model, s, torch.empty(s.shape, dtype=s.dtype, device="meta"))


def stream_into(model: nn.Module, ckpt: HFCheckpoint, *, dtype: torch.dtype = torch.float32, strict: bool = True,
                units=None, on_unit: Callable[[str, list[str]], None] | None = None) -> LoadReport:
    """Materialise the meta `model`'s tensors from `ckpt`, one unit at a time, and keep them.

    `units`: the offload unit policy (default: the engine's detection; see hf_units). After a unit's tensors are
    in place, `on_unit(unit_name, its state_dict names)` runs; it may move them elsewhere before the next unit is
    read. Floating tensors become `dtype`; integer buffers keep theirs.
    """
    with UnitStreamer(model, ckpt, dtype=dtype, strict=strict, units=units) as streamer:
        for unit in streamer.groups:
            names = streamer.load(unit)
            if on_unit is not None:
                on_unit(unit, names)
    return streamer.report


def load_hf_model(path: str | Path, *, dtype: torch.dtype = torch.float32, strict: bool = True,
                  units=None,
                  on_unit: Callable[[str, list[str]], None] | None = None) -> nn.Module:
    """A transformers causal-LM model loaded from a local folder, streamed one unit at a time.

    A config-only folder (no weights) gives a randomly initialised model, built the same way, unit by unit. The
    model is in train mode, on the CPU (unless `on_unit` moved its tensors), in `dtype`.
    """
    ckpt = HFCheckpoint.open(path)
    model = build_meta_model(ckpt.config)
    stream_into(model, ckpt, dtype=dtype, strict=strict and ckpt.has_weights, units=units, on_unit=on_unit)
    model.train()
    return model
