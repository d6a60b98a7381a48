"""Which offload unit each tensor of a model belongs to, for loading unit by unit.

Why here: the loader streams a checkpoint one unit at a time so that each unit can go to its tier before the next
one is read, and it must group tensors exactly as the engine will (the same unit names, the same leftovers, tied
parameters in the root unit), or a unit would arrive in pieces. So the grouping *is* the engine's
(`tightfit.offload.units.find_units`), applied to parameters; persistent buffers, which the engine does not move
as unit state, join the unit whose module holds them.

Default policy (the engine's): each child of an `nn.ModuleList` whose children share a class is a unit, e.g.
GPT-2's `transformer.h.3`, Llama's `model.layers.3`, `nn.TransformerEncoder`'s `layers.3`, the reference GPT's
`blocks.3`; every other parameter belongs to `ROOT_UNIT`. An explicit policy (module paths or fnmatch patterns,
e.g. `["0", "2", "4"]` or `["net.*"]` for an `nn.Sequential` MLP) replaces it. docs/MODELS.md lists the models.
"""

from __future__ import annotations

import torch.nn as nn

from tightfit.offload.placement import ROOT_UNIT
from tightfit.offload.step.units import UnitPolicy, find_units


def slot_units(model: nn.Module, names: list[str], policy: UnitPolicy = None) -> dict[str, list[str]]:
    """`names` (state_dict names: parameters, first name of each tie, and persistent buffers) grouped by unit,
    in the engine's unit order (ROOT_UNIT first)."""
    specs = find_units(model, policy)
    unit_of_param = {slot.name: spec.name for spec in specs for slot in spec.slots}
    paths = sorted((s.name for s in specs if not s.is_root), key=len, reverse=True)  # innermost first
    groups: dict[str, list[str]] = {spec.name: [] for spec in specs}
    for n in names:
        unit = unit_of_param.get(n) or next((u for u in paths if n.startswith(u + ".")), ROOT_UNIT)
        groups[unit].append(n)
    return {u: ns for u, ns in groups.items() if ns}
