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
missing key; missing optimizer keys mean "fresh optimizer state", a missing model key is an error, and a value of
another shape is an error too (never broadcast into a parameter). `export_groups` yields the same tensors a unit at
a time (the engine's units, a large one in pieces of EXPORT_PIECE bytes; a plain model grouped the same way), each
tensor a fresh copy the caller owns: a checkpoint writer holds them while training goes on
(train/checkpoint_writer.py).

`trainable_only=True` limits both to the parameters with `requires_grad` (and their moments): the state an optimizer
changes. Frozen parameters (a LoRA fine-tune's base weights) never change in training, so a resumable checkpoint
need not carry them again (tightfit/integrations/hf_trainer.py writes its optimizer file this way).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.memory_model import EXPORT_PIECE
from tightfit.offload.runtime.aligned import aligned_empty
from tightfit.offload.step.engine import OffloadEngine, find_engine
from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ, PARAMS, OffloadUnit
from tightfit.offload.placement import State
from tightfit.offload.step.units import find_units

_MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def export_state(model: nn.Module, opt: torch.optim.Optimizer | None = None, *,
                 trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, CPU tensor) for the model's parameters and, if `opt` is given, its AdamW state."""
    for _, items in export_groups(model, opt, trainable_only=trainable_only):
        yield from items


def export_groups(model: nn.Module, opt: torch.optim.Optimizer | None = None, *, trainable_only: bool = False
                  ) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """What `export_state` yields, one unit at a time: (unit name, [(key, CPU tensor), ...]), fresh copies."""
    engine = find_engine(model)
    if engine is None:
        yield from _export_plain(model, opt, trainable_only)
    else:
        yield from _export_wrapped(engine, opt is not None, trainable_only)


def import_state(model: nn.Module, opt: torch.optim.Optimizer | None, get: Callable[[str], torch.Tensor], *,
                 trainable_only: bool = False) -> None:
    """Load what `export_state` wrote (from a plain or a wrapped run) into `model` and, if given, `opt`.
    trainable_only: only parameters with requires_grad are read; frozen ones keep their values."""
    engine = find_engine(model)
    if engine is None:
        _import_plain(model, opt, get, trainable_only)
    else:
        _import_wrapped(engine, opt is not None, get, trainable_only)


def _checked(key: str, value: torch.Tensor, shape) -> torch.Tensor:
    """`value` if it has `shape`; a copy_ would broadcast a scalar into a whole parameter."""
    if tuple(value.shape) != tuple(shape):
        raise UsageError(f"checkpoint value {key} has shape {list(value.shape)}, the model {list(shape)}; was it "
                         "written for another model?")
    return value


def _model_value(get, name: str, shape) -> torch.Tensor:
    try:
        return _checked(f"model.{name}", get(f"model.{name}"), shape)
    except KeyError:
        raise UsageError(f"checkpoint has no value for parameter {name!r} (key model.{name}); was it written for "
                         "another model?") from None


def _optim_values(get, name: str, shape) -> dict[str, torch.Tensor] | None:
    try:
        values = {k: get(f"optim.{name}.{k}") for k in (*_MOMENTS, "step")}
    except KeyError:
        return None
    for k in _MOMENTS:
        _checked(f"optim.{name}.{k}", values[k], shape)
    _checked(f"optim.{name}.step", values["step"].reshape(()) if values["step"].numel() == 1 else values["step"], ())
    return values


# ---- plain model + torch optimizer ----------------------------------------------------------------------------

def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _export_plain(model, opt, trainable_only=False):
    """Grouped as the engine groups the model's units (`find_units`), so a plain run's shards match a wrapped one's."""
    params = dict(model.named_parameters())
    stepped = {id(p) for g in opt.param_groups for p in g["params"] if opt.state.get(p)} if opt is not None else set()
    for spec in find_units(model):
        slots = [s for s in spec.slots if params[s.name].requires_grad or not trainable_only]
        items = [(f"model.{s.name}", _copy(params[s.name])) for s in slots]
        for s in slots:
            p = params[s.name]
            if id(p) in stepped:
                st = opt.state[p]
                items += [(f"optim.{s.name}.{k}", _copy(torch.as_tensor(st[k], dtype=torch.float32)))
                          for k in (*_MOMENTS, "step")]
        if items:
            yield spec.name, items


def _import_plain(model, opt, get, trainable_only=False):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad or not trainable_only}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_model_value(get, name, p.shape))
    if opt is None:
        return
    for name, p in params.items():
        values = _optim_values(get, name, p.shape)
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


def quiesce(engine: OffloadEngine) -> None:
    """Wait until every state is at rest in its tier: gradients landed, steps during backward done, write-backs
    written. The stores would order reads after the writes anyway; this surfaces a failed write here."""
    engine.wait_grads()
    engine.wait_steps()
    engine.wait_writes()


def export_pieces(engine: OffloadEngine, unit: OffloadUnit, with_optim: bool, trainable_only: bool = False,
                  piece_bytes: int = EXPORT_PIECE) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One unit's (key, tensor) pairs in pieces of at most `piece_bytes` (a larger tensor is a piece of its own),
    each tensor read from its tier on its own into a fresh host tensor when its piece is asked for: a unit's export
    never holds the whole unit (a 3B Llama's embedding is 4.7 GB of master and moments). Keys: the parameters,
    then per stepped parameter its moments and step count."""
    slots = unit.trainable if trainable_only else unit.spec.slots
    reads = [(f"model.{slot.name}", slot.numel * 4, lambda slot=slot: _read_master_slot(engine, unit, slot))
             for slot in slots]
    if with_optim and not unit.moments_empty:
        for i, slot in enumerate(unit.trainable):
            if unit.steps[i] is None:
                continue
            for entry in _MOMENTS:
                reads.append((f"optim.{slot.name}.{entry}", slot.numel * 4,
                              lambda slot=slot, entry=entry: _read_slot(unit, State.OPTIM, entry, slot)))
            reads.append((f"optim.{slot.name}.step", 4, lambda i=i: unit.steps[i].detach().cpu().clone()))
    piece, held = [], 0
    for key, nbytes, read in reads:
        if piece and held + nbytes > piece_bytes:
            yield piece
            piece, held = [], 0
        piece.append((key, read()))
        held += nbytes
    if piece:
        yield piece


def _read_slot(unit: OffloadUnit, state: State, entry: str, slot, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    out = torch.empty(slot.numel, dtype=dtype)
    unit.store[state].load(unit.name, entry, out, start=slot.offset).result()
    return out.view(slot.shape)


def _read_master_slot(engine: OffloadEngine, unit: OffloadUnit, slot) -> torch.Tensor:
    """One parameter's fp32 master values (a frozen one past the master's end: its compute copy, upcast), as
    `master_io.read_master` reads the whole unit."""
    if slot.offset + slot.numel <= unit.master_numel:
        return _read_slot(unit, State.MASTER, unit.master_entry, slot)
    return _read_slot(unit, State.PARAMS, PARAMS, slot, engine.compute_dtype).float()


def _export_wrapped(engine: OffloadEngine, with_optim: bool, trainable_only: bool = False):
    quiesce(engine)
    for unit in engine.units.values():
        if trainable_only and not unit.trainable:
            continue
        for piece in export_pieces(engine, unit, with_optim, trainable_only):
            yield unit.name, piece


def _import_wrapped(engine: OffloadEngine, with_optim: bool, get, trainable_only: bool = False):
    engine.zero_grad()
    for unit in engine.units.values():
        if trainable_only and not unit.trainable or not unit.holds_params:  # ZeRO-3: its owner reads it
            continue
        if trainable_only:  # frozen slots keep their values: start from the current ones
            engine.wait_writes()
            master = engine.read_master(unit)
        else:
            master = aligned_empty(unit.spec.numel, torch.float32)
            master.zero_()
        for slot in (unit.trainable if trainable_only else unit.spec.slots):
            slot.view(master).copy_(_model_value(get, slot.name, slot.shape))
        engine.write_master(unit, master)
        del master
        if not with_optim or not unit.trainable or not unit.steps_here:  # another rank's moments: not here
            continue
        moments = {e: torch.zeros(unit.spec.train_numel, dtype=torch.float32) for e in _MOMENTS}
        found = False
        for i, slot in enumerate(unit.trainable):
            values = _optim_values(get, slot.name, slot.shape)
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
