"""A unit's fp32 master values in and out of its tiers, whole: at wrap time, for state dicts and checkpoints.

Why apart from the step: these are not on the training path. They read or write a unit's values through its stores
synchronously, with buffers of their own (not the pool's: no job of the step is running while they do), and the
engine makes every cached or materialised copy stale afterwards (`OffloadEngine.write_master`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tightfit.offload.placement import State, Tier
from tightfit.offload.runtime.aligned import aligned_empty
from tightfit.offload.step.unit import MASTER, PARAMS, OffloadUnit
from tightfit.offload.tiers.stores import TierStore


def replace_meta_params(model: nn.Module) -> bool:
    """Swap parameters on the meta device for storage-less CPU parameters of the same shape (ties kept); whether
    there were any.

    Why: a model too large for host memory is built under `torch.device("meta")`, wrapped, and then given its
    values unit by unit with `state_io.import_state`; `param.data` cannot be re-pointed from meta to real memory,
    so those parameters are replaced (before units are found, so the engine only ever sees the new ones).
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    empty = torch.empty(0, dtype=p.dtype).set_(torch.UntypedStorage(0), 0, p.shape)
                    new[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                module._parameters[key] = new[id(p)]
    return bool(new)


def initialise(unit: OffloadUnit, stores: dict[Tier, TierStore], meta_init: bool, compute_dtype: torch.dtype) -> None:
    """Allocate the unit's entries in their stores, write the model's current values, bind the params."""
    for tier, entries in unit.entries().items():
        stores[tier].allocate(unit.name, entries, lock=unit.locked)
    if not meta_init:  # a model built on the meta device gets its values from import_state
        master = aligned_empty(unit.spec.numel, torch.float32)
        master.zero_()  # padding between parameters stays zero forever
        for slot in unit.spec.slots:
            slot.view(master).copy_(slot.param.detach())
        write_master(unit, master, compute_dtype)
    unit.bind()


def write_master(unit: OffloadUnit, master: torch.Tensor, compute_dtype: torch.dtype) -> None:
    """Store fp32 master values (a host tensor of the unit's flat size) and the compute params cast from them.
    A separate master keeps only the trainable prefix ([Note: frozen parameters] in unit.py)."""
    if not unit.holds_params:  # its owner holds and sends them (ZeRO-3): nothing of it is kept here
        return
    if unit.master_entry == MASTER:
        if unit.master_numel:
            unit.store[State.MASTER].save(unit.name, MASTER, master[:unit.master_numel]).result()
        if not unit.casts_on_device:  # else the device casts the master as it uploads it: no copy at rest
            unit.store[State.PARAMS].save(unit.name, PARAMS, master.to(compute_dtype)).result()
    else:
        unit.store[State.MASTER].save(unit.name, PARAMS, master).result()


def write_params(unit: OffloadUnit, params: torch.Tensor) -> None:
    """Store compute-dtype values (a host tensor of the unit's flat size) of a unit whose only copy here is its
    compute copy: one another rank steps ([Note: optimizer states sharded by unit] in parallel/sharded_optimizer.py),
    whose fp32 master, where there is one, lives there."""
    assert not unit.steps_here and not unit.casts_on_device, unit.name
    unit.store[State.PARAMS].save(unit.name, PARAMS, params).result()


def read_master(unit: OffloadUnit, compute_dtype: torch.dtype) -> torch.Tensor:
    """The unit's fp32 master values as a new host tensor."""
    assert unit.holds_params, unit.name  # another rank's (ZeRO-3): its owner reads them
    out = aligned_empty(unit.spec.numel, torch.float32)
    if unit.master_entry == MASTER and unit.master_numel < unit.spec.numel:  # frozen tail: the compute copy
        params = aligned_empty(unit.spec.numel, compute_dtype)
        unit.store[State.PARAMS].load(unit.name, PARAMS, params).result()
        out.copy_(params)
        del params
    if unit.master_numel:
        unit.store[State.MASTER].load(unit.name, unit.master_entry, out[:unit.master_numel]).result()
    return out
