"""Training state in and out, with the keys a plain model + `torch.optim.AdamW` would have.

Why these keys: the trainer's checkpoint code is shared between plain and offloaded runs, and a checkpoint written
by one can be resumed by the other. Keys (values are CPU tensors):
    model.<param name>               fp32 master values (the parameter itself for a plain model)
    optim.<param name>.exp_avg       Adam first moment       } only for parameters the optimizer has stepped,
    optim.<param name>.exp_avg_sq    Adam second moment      } as torch.optim.AdamW's state
    optim.<param name>.step          step count (float32 scalar)
`<param name>` is what `model.named_parameters()` gives (the first name of a tied parameter).

Why streamed: an offloaded model's state does not fit in memory at once. `export_state` yields one tensor at a time,
reading a unit's states from their tiers only when its turn comes; `import_state` pulls tensors through a
`get(key)` callable (e.g. a safetensors file's `get_tensor`) one unit at a time. `get` raises KeyError for a
missing key; missing optimizer keys mean "fresh optimizer state", a missing model key is an error.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.aligned import aligned_empty
from tightfit.offload.engine import _ENGINES, OffloadEngine
from tightfit.offload.flat_unit import EXP_AVG, EXP_AVG_SQ, OffloadUnit
from tightfit.offload.placement import State

_MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def export_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, CPU tensor) for the model's parameters and, if `opt` is given, its AdamW state."""
    engine = _ENGINES.get(model)
    if engine is None:
        yield from _export_plain(model, opt)
    else:
        yield from _export_wrapped(engine, opt is not None)


def import_state(model: nn.Module, opt: torch.optim.Optimizer | None, get: Callable[[str], torch.Tensor]) -> None:
    """Load what `export_state` wrote (from a plain or a wrapped run) into `model` and, if given, `opt`."""
    engine = _ENGINES.get(model)
    if engine is None:
        _import_plain(model, opt, get)
    else:
        _import_wrapped(engine, opt is not None, get)


def _model_value(get, name: str) -> torch.Tensor:
    try:
        return get(f"model.{name}")
    except KeyError:
        raise UsageError(f"checkpoint has no value for parameter {name!r} (key model.{name}); was it written for "
                         "another model?") from None


def _optim_values(get, name: str) -> dict[str, torch.Tensor] | None:
    try:
        return {k: get(f"optim.{name}.{k}") for k in (*_MOMENTS, "step")}
    except KeyError:
        return None


# ---- plain model + torch optimizer ----------------------------------------------------------------------------

def _export_plain(model, opt):
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        yield f"model.{name}", p.detach().cpu()
    if opt is None:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st and id(p) in names:
                for k in (*_MOMENTS, "step"):
                    yield f"optim.{names[id(p)]}.{k}", torch.as_tensor(st[k], dtype=torch.float32).detach().cpu()


def _import_plain(model, opt, get):
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_model_value(get, name))
    if opt is None:
        return
    for name, p in params.items():
        values = _optim_values(get, name)
        if values is not None and any(p is q for g in opt.param_groups for q in g["params"]):
            opt.state[p] = {"step": values["step"].to(torch.float32).clone(),
                            **{k: values[k].to(p.device, p.dtype).clone() for k in _MOMENTS}}


# ---- wrapped model ---------------------------------------------------------------------------------------------

def _read_moments(unit: OffloadUnit) -> dict[str, torch.Tensor]:
    out = {}
    for entry in _MOMENTS:
        buf = aligned_empty(unit.spec.train_numel, torch.float32)
        unit.store[State.OPTIM].load(unit.name, entry, buf).result()
        out[entry] = buf
    return out


def _export_wrapped(engine: OffloadEngine, with_optim: bool):
    engine.wait_grads()
    engine.wait_early_steps()
    engine.wait_writes()  # the stores would order the reads after them; this surfaces a failed write here
    for unit in engine.units.values():
        master = engine.read_master(unit)
        for slot in unit.spec.slots:
            yield f"model.{slot.name}", slot.view(master).clone()
        del master
        if not with_optim or unit.moments_empty:
            continue
        moments = _read_moments(unit)
        for i, slot in enumerate(unit.trainable):
            if unit.steps[i] is None:
                continue
            for entry in _MOMENTS:
                yield f"optim.{slot.name}.{entry}", slot.view(moments[entry]).clone()
            yield f"optim.{slot.name}.step", unit.steps[i].detach().cpu().clone()


def _import_wrapped(engine: OffloadEngine, with_optim: bool, get):
    engine.zero_grad()
    for unit in engine.units.values():
        master = aligned_empty(unit.spec.numel, torch.float32)
        master.zero_()
        for slot in unit.spec.slots:
            value = _model_value(get, slot.name)
            if tuple(value.shape) != tuple(slot.shape):
                raise UsageError(f"checkpoint value model.{slot.name} has shape {tuple(value.shape)}, the model "
                                 f"{tuple(slot.shape)}")
            slot.view(master).copy_(value)
        engine.write_master(unit, master)
        del master
        if not with_optim or not unit.trainable:
            continue
        moments = {e: torch.zeros(unit.spec.train_numel, dtype=torch.float32) for e in _MOMENTS}
        found = False
        for i, slot in enumerate(unit.trainable):
            values = _optim_values(get, slot.name)
            unit.steps[i] = None
            if values is None:
                continue
            found = True
            for entry in _MOMENTS:
                slot.view(moments[entry]).copy_(values[entry])
            unit.steps[i] = values["step"].to(torch.float32).reshape(()).clone()
        if found:
            for entry in _MOMENTS:
                unit.store[State.OPTIM].save(unit.name, entry, moments[entry]).result()
        unit.moments_empty = not found
