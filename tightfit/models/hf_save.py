"""Save a model as a Hugging Face checkpoint folder, one tensor at a time.

Why: a fine-tuned model must open in the tools people already use, with no conversion step:
`transformers.AutoModelForCausalLM.from_pretrained(folder)` reads what this writes. And a model that did not fit in
memory to train does not fit to save either, so nothing here gathers a state dict: the shard layout is planned
from names, shapes and dtypes alone, each shard's header is written first, and each tensor's bytes go to their
offset as the tensor arrives (hf_safetensors.ShardWriter), from the model itself or from any stream of
`(name, tensor)` pairs such as the offload engine's export of its fp32 master weights. Memory: one tensor.

Layout (what `save_pretrained` writes): `config.json`, `generation_config.json` when the model has one, and
`model.safetensors` when everything fits in one shard, else `model-0000x-of-0000y.safetensors` plus
`model.safetensors.index.json`. Tied tensors are stored once, under the name transformers keeps (it drops the
names in `model.all_tied_weights_keys`, e.g. `lm_head.weight`, and re-ties on load).

Atomicity: everything is written into a temporary sibling folder, then swapped in with two renames. A crash leaves
either the old folder, or the old one renamed `.<name>.old-*` next to the complete new one; never a folder that
mixes shards of two saves. Files in an existing folder that this does not write (a tokenizer, a README) are kept.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.models.hf_load import INDEX_NAME, SINGLE_NAME, model_slots
from tightfit.models.hf_safetensors import ShardWriter, TensorSpec
from tightfit.utils.sizes import parse_size

_WEIGHT_FILES = ("model*.safetensors", INDEX_NAME, "pytorch_model*.bin", "pytorch_model.bin.index.json")
"""Files of an existing folder that the new save replaces (kept ones would contradict the new weights)."""


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Specs split in order into shards of at most `max_shard_size` bytes (a larger tensor gets its own shard)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _shard_names(n: int) -> list[str]:
    return [SINGLE_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def saved_names(model: nn.Module) -> dict[str, str]:
    """Every state_dict name of the model -> the name it is saved under (tied names map to the kept one)."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    out = {}
    for slot in model_slots(model):
        kept = next((n for n in slot.names if n not in tied_targets), slot.names[0])
        out.update({n: kept for n in slot.names})
    return out


def _is_wrapped(model: nn.Module) -> bool:
    from tightfit.offload.step.engine import engine_of

    try:
        engine_of(model)
    except UsageError:
        return False
    return True


def _model_tensors(model: nn.Module, names: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
    for n in names:
        try:
            yield n, model.get_parameter(n)
        except AttributeError:
            yield n, model.get_buffer(n)


def save_hf_model(model: nn.Module, folder: str | Path, *, max_shard_size: int | str = "5GB",
                  dtype: torch.dtype | None = None, tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                  strip_prefix: str = "") -> Path:
    """Write `model` (a transformers causal-LM model) to `folder` in the Hugging Face layout; returns the folder.

    dtype: store floating tensors in this dtype (default: the dtype each tensor has in the model).
    tensors: where the values come from (default: the model's own tensors or, for a model wrapped by
        `tightfit.wrap`, the engine's fp32 master weights, streamed from their tiers a unit at a time by
        `tightfit.offload.module_state.iter_state_dict`). Names are state_dict names, after
        removing `strip_prefix` (the engine's `export_state` yields "model.<name>": pass strip_prefix="model.");
        names that are not model tensors (optimizer moments) are skipped; every saved tensor must arrive.
    The model's shapes and dtypes plan the files, so its parameters may live anywhere (even on meta) when
    `tensors` supplies the values.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise UsageError(f"save_hf_model: {type(model).__name__} has no transformers config; only Hugging Face "
                         "models are saved in the Hugging Face layout")
    folder = Path(folder).expanduser()
    limit = parse_size(max_shard_size, "max_shard_size")
    if limit <= 0:
        raise UsageError(f"max_shard_size: must be positive, got {max_shard_size!r}")

    if tensors is None and _is_wrapped(model):
        from tightfit.offload.model_state.module_state import iter_state_dict

        # The parameters of a wrapped model are compute-dtype views that are empty between uses; the values to
        # save are the fp32 masters, one unit at a time from whichever tier holds them (what state_dict() gives).
        tensors, dtype = iter_state_dict(model), dtype or torch.float32
    kept = saved_names(model)
    slots = {s.names[0]: s for s in model_slots(model)}
    specs = []
    for s in slots.values():
        want = dtype if dtype is not None and s.dtype.is_floating_point else s.dtype
        specs.append(TensorSpec(kept[s.names[0]], want, s.shape))
    shards = plan_shards(specs, limit)
    files = _shard_names(len(shards))

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        writers = {}
        for file, shard in zip(files, shards):
            w = ShardWriter(tmp / file, shard)
            writers.update({s.name: w for s in shard})
        source = tensors if tensors is not None else _model_tensors(model, kept.values())
        written = set()
        for name, t in source:
            if strip_prefix and name.startswith(strip_prefix):
                name = name[len(strip_prefix):]
            name = kept.get(name)
            if name is not None and name not in written:  # a tied tensor arrives under each of its names
                writers[name].write(name, t)
                written.add(name)
        for w in {id(w): w for w in writers.values()}.values():
            w.close()
        if len(files) > 1:
            weight_map = {s.name: f for f, shard in zip(files, shards) for s in shard}
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs),
                                  "total_parameters": sum(s.nbytes // s.dtype.itemsize for s in specs)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        _save_configs(model, tmp, dtype)
        _swap_in(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _save_configs(model: nn.Module, tmp: Path, dtype: torch.dtype | None) -> None:
    """config.json (with `dtype` set to what the shards hold, so `from_pretrained` keeps it) and the generation config."""
    config = copy.deepcopy(model.config)
    floats = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    stored = dtype or (floats[0] if floats else torch.float32)
    config.dtype = str(stored).removeprefix("torch.")
    config.save_pretrained(tmp)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(tmp)


def _swap_in(tmp: Path, folder: Path) -> None:
    """Make `tmp` become `folder`, keeping the old folder's non-weight files (hard links: no bytes copied)."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    if not folder.is_dir():
        raise UsageError(f"{folder}: exists and is not a folder; choose another output path")
    stale = {p.name for pattern in _WEIGHT_FILES for p in folder.glob(pattern)}
    for p in folder.iterdir():
        if p.name in stale or (tmp / p.name).exists():
            continue
        dst = tmp / p.name
        if p.is_dir():
            shutil.copytree(p, dst, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, dst)
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    os.replace(folder, old / folder.name)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
