"""Load a Hugging Face checkpoint straight into the offload engine's tiers: the model never exists in host memory.

Why: `load_hf_model` materialises the whole model on the host, which is exactly what a model larger than RAM
cannot afford. Here the model is built on the meta device, wrapped (the engine allocates each unit's states in the
tiers the placement picks, holding no values yet), and the engine then pulls the values unit by unit through
`state_io.import_state`, writing each unit's fp32 master weights to its tier before asking for the next unit.

Where the values come from: a second meta model of the same config, the *shadow*, that `UnitStreamer` fills one
unit at a time (reading each tensor straight from its shard, running the model's own init for missing tensors,
keeping ties) and empties again as soon as the engine moves on. Host memory at any moment: one unit in the shadow
plus the engine's flat master buffer for that unit, i.e. about 2x the largest unit in fp32, plus whatever the
placement keeps on the host tier.

    model = load_hf_wrapped("llama-1b/", Placement.everywhere("nvme", nvme_dir="/mnt/swap"))
    opt = tightfit.optim.AdamW(model.parameters(), lr=1e-5)
    ... ordinary loop ...
    save_hf_model(model, "out/")   # streams the fp32 masters back out of the tiers
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.models.hf_load import HFCheckpoint, UnitStreamer, build_meta_model
from tightfit.offload.placement import Placement


def meta_model(ckpt: HFCheckpoint, *, strict: bool = True, units=None) -> nn.Module:
    """The checkpoint's model on the meta device, ready for `tightfit.wrap`: parameters on meta, buffers real.

    Persistent buffers are not the engine's to fill (it only moves them to the device), so they are read here;
    non-persistent ones (rotary tables) were computed by `build_meta_model`.
    """
    model = build_meta_model(ckpt.config)
    with UnitStreamer(model, ckpt, strict=strict and ckpt.has_weights, units=units) as streamer:
        for unit in streamer.groups:
            streamer.load(unit, buffers_only=True)
    return model


@contextmanager
def checkpoint_values(ckpt: HFCheckpoint, *, strict: bool = True,
                      units=None) -> Iterator[Callable[[str], torch.Tensor]]:
    """A `get(key)` for `state_io.import_state` (and the trainer's `import_state`) serving "model.<name>" keys
    from the checkpoint, one unit in memory at a time; other keys raise KeyError ("no optimizer state yet").

    Values are fp32 CPU tensors owned by the shadow model; the caller copies them before asking for the next
    unit (import_state does). Asking in unit order reads each tensor once; any order works, at the cost of
    re-reading.
    """
    shadow = build_meta_model(ckpt.config)
    current: list[str | None] = [None]  # the shadow unit holding values right now (at most one)
    with UnitStreamer(shadow, ckpt, dtype=torch.float32, strict=strict and ckpt.has_weights,
                      units=units) as streamer:
        def get(key: str) -> torch.Tensor:
            name = key.removeprefix("model.")
            unit = streamer.unit_of.get(name) if key.startswith("model.") else None
            if unit is None:
                raise KeyError(key)
            if unit != current[0]:
                if current[0] is not None:
                    streamer.release(current[0])
                streamer.load(unit)
                current[0] = unit
            try:
                return shadow.get_parameter(name).detach()
            except AttributeError:
                return shadow.get_buffer(name)

        try:
            yield get
        finally:
            if current[0] is not None:
                streamer.release(current[0])


def fill_wrapped(model: nn.Module, ckpt: HFCheckpoint, *, strict: bool = True, units=None) -> None:
    """Give a wrapped, meta-initialised `model` the checkpoint's values, one unit at a time."""
    from tightfit.offload.model_state.state_io import import_state

    with checkpoint_values(ckpt, strict=strict, units=units) as get:
        import_state(model, None, get)


def load_hf_wrapped(path: str | Path, placement: Placement, *, compute_dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None, units=None, strict: bool = True,
                    freeze: Sequence[str] = ()) -> nn.Module:
    """A transformers causal-LM model from a local folder, wrapped by `tightfit.wrap` with `placement`, its
    weights streamed from disk into the placement's tiers.

    units: the engine's unit policy (module paths, fnmatch patterns, or a callable); default: repeated blocks.
    freeze: fnmatch patterns of parameter names to freeze (requires_grad=False) before wrapping, so the engine
        allocates no gradient or optimizer state for them, e.g. ["model.embed_tokens.*", "lm_head.*"].
    """
    import tightfit

    ckpt = HFCheckpoint.open(path)
    model = meta_model(ckpt, strict=strict, units=units)
    for pattern in freeze:
        hits = [p for n, p in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise UsageError(f"freeze: no parameter of {type(model).__name__} matches {pattern!r}; see "
                             "model.named_parameters()")
        for p in hits:
            p.requires_grad_(False)
    tightfit.wrap(model, placement, compute_dtype=compute_dtype, device=device, units=units)
    fill_wrapped(model, ckpt, strict=strict, units=units)
    return model.train()
