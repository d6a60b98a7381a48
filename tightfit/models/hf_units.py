"""Which offload unit each tensor of a model belongs to, for loading and saving unit by unit.

Why here: the loader streams a checkpoint one unit at a time so that each unit can go to its tier before the next
one is read, and it must group tensors exactly as the engine will (the same unit names, the same leftovers), or a
unit would arrive split. The rule is the engine's: a unit is a child of an `nn.ModuleList` whose children repeat
(same class, the same parameter names and shapes; e.g. GPT-2's `transformer.h.3`, Llama's `model.layers.3`,
`nn.TransformerEncoder`'s `layers.3`, the reference GPT's `blocks.3`); every other tensor belongs to `ROOT_UNIT`.
An explicit list of module paths replaces the rule (e.g. `["0", "2", "4"]` for an `nn.Sequential` MLP, where
nothing repeats inside a ModuleList).
"""

from __future__ import annotations

import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.placement import ROOT_UNIT


def _signature(module: nn.Module) -> tuple:
    return (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


def detect_units(model: nn.Module) -> list[str]:
    """Module paths of the repeated blocks: the children of each ModuleList whose children all look alike."""
    units = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            children = list(module.children())
            if len({_signature(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
                units += [f"{path}.{i}" if path else str(i) for i in range(len(children))]
    # A repeated block nested inside another repeated block belongs to the outer one.
    return [u for u in units if not any(u.startswith(o + ".") for o in units)]


def unit_of(name: str, units: list[str]) -> str:
    """The unit a state_dict name belongs to: the unit path that prefixes it, else ROOT_UNIT."""
    for u in units:
        if name.startswith(u + "."):
            return u
    return ROOT_UNIT


def slot_units(model: nn.Module, names: list[str], units: list[str] | None = None) -> dict[str, list[str]]:
    """`names` grouped by unit, units in the order their first tensor appears (usually ROOT_UNIT first)."""
    if units is None:
        units = detect_units(model)
    else:
        modules = dict(model.named_modules())
        bad = [u for u in units if u not in modules or u == ""]
        if bad:
            raise UsageError(f"unit policy: {bad[0]!r} is not a module path of {type(model).__name__}; "
                             "give paths as in model.named_modules(), e.g. 'model.layers.0'")
    # Longest paths first, so an explicit policy naming both "a" and "a.b" puts a.b's tensors in a.b.
    ordered = sorted(units, key=len, reverse=True)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(unit_of(n, ordered), []).append(n)
    return groups
