"""Grouping a model's parameters into units and laying each unit out as one flat buffer.

Why: the engine moves parameters, gradients and optimizer moments between tiers a unit at a time. One flat
buffer per unit turns dozens of small transfers into one large one (what disks and PCIe need to reach their
bandwidth), gives the NVMe tier one contiguous entry per state, and lets the optimizer step a unit with one fused
kernel call over views. This file only decides *which* parameters form a unit and *where* each sits in the flat
buffer; it moves nothing.

Unit policy (first match wins, walking the module tree top-down, never descending into a chosen unit):
- default: every child of an `nn.ModuleList` whose children all have the same class (a stack of blocks);
- a list of module paths (fnmatch patterns allowed, e.g. "blocks.*", "tok_emb");
- a callable `(module_path, module) -> bool`.
Every parameter that belongs to no chosen module, or that is shared between two units (tied weights), goes to the
`ROOT_UNIT` unit.

[Note: grouped blocks] With `min_bytes`, consecutive chosen blocks of one ModuleList (chosen by the default policy
or an explicit one) are joined into a unit of at least that many bytes of fp32 parameters, named after its first
and last index ("blocks.0-3"). Why: a unit is the engine's transfer size, and a disk reaches its bandwidth only on
large requests issued together; a model of many small blocks (7 MB each) moves them in lone bursts the disk serves
at ~0.75 of its sequential speed, and 28 MB units at ~0.9 (benchmarks/RESULTS.md, "Batch H"). The price is device
memory: two units compute at once in backward, so the device budget must hold two groups. The members must run in
index order (a block stack's `for block in self.blocks`): the hooks materialise the unit at its first member's
forward and release it after the last member's. A `group_key` keeps blocks apart whose placement or checkpointing
differ.

Layout of a unit's flat buffer (elements, one dtype): trainable parameters first, each starting at a multiple of
`ALIGN` elements, then frozen ones. Gradients and optimizer moments cover only the trainable prefix
`[0, train_numel)`, so a frozen parameter has no gradient or optimizer state anywhere.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.placement import ROOT_UNIT

ALIGN = 16
"""Element alignment of each parameter inside a flat buffer (64 bytes in fp32): keeps vectorised kernels on
their fast path and makes the views' data pointers cache-line aligned."""

UnitPolicy = Union[None, Sequence[str], Callable[[str, nn.Module], bool]]


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits in its unit's flat buffer."""

    name: str
    """Qualified parameter name, as `model.named_parameters()` gives it (the first name of a tied parameter)."""
    param: nn.Parameter
    offset: int
    """First element in the flat buffer."""
    shape: torch.Size
    trainable: bool

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's region of `flat`, shaped like the parameter."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass
class UnitSpec:
    """The parameters of one unit and their layout. Immutable after `find_units`."""

    name: str
    module: nn.Module | None
    """The module whose forward brackets the unit's use (the first member of a group); None for the root unit,
    whose forward is the model's own (the model is not held here: an engine keeping it alive would keep a dropped
    model, its buffers and its swap files forever)."""
    members: list[tuple[str, nn.Module]] = field(default_factory=list)
    """(path, module) of every module in the unit, in call order: one, or a group of consecutive blocks ([Note:
    grouped blocks]). Empty for the root unit."""
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0
    """Elements in the flat buffer (all parameters, with alignment padding)."""
    train_numel: int = 0
    """Elements of the trainable prefix (gradients and optimizer moments have this size)."""

    @property
    def modules(self) -> list[nn.Module]:
        return [m for _, m in self.members]

    @property
    def trainable(self) -> list[Slot]:
        return [s for s in self.slots if s.trainable]

    @property
    def is_root(self) -> bool:
        return self.name == ROOT_UNIT


def slot_views(slots: Sequence[Slot], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each slot's region of `flat`, shaped like its parameter, in the order of `slots`."""
    return [s.view(flat) for s in slots]


def padded(n: int) -> int:
    """Elements `n` take in a flat buffer: every parameter starts, and every buffer ends, on `ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def is_repeated_block(path: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """The default unit rule: a child of a ModuleList (2+ entries) whose children all share one class."""
    if not isinstance(parent, nn.ModuleList) or len(parent) < 2:
        return False
    return len({type(m) for m in parent}) == 1


def _choose_modules(model: nn.Module, policy: UnitPolicy) -> dict[str, nn.Module]:
    """Module path -> module for every non-root unit, in module-tree order."""
    if policy is not None and not callable(policy):
        patterns = [policy] if isinstance(policy, str) else list(policy)
        if not all(isinstance(p, str) for p in patterns):
            raise UsageError("wrap(units=...): give a list of module paths or a callable(path, module) -> bool")
        names = dict(model.named_modules())
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names if n):
                raise UsageError(f"wrap(units=...): no module matches {pat!r}; see model.named_modules()")
        match = lambda path, module, parent: any(fnmatch.fnmatchcase(path, p) for p in patterns)  # noqa: E731
    elif callable(policy):
        match = lambda path, module, parent: bool(policy(path, module))  # noqa: E731
    else:
        match = is_repeated_block
    chosen: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            path = f"{prefix}.{child_name}" if prefix else child_name
            if match(path, child, module):
                if path == ROOT_UNIT:
                    raise UsageError(f"wrap(units=...): a module may not be named {ROOT_UNIT!r} (reserved)")
                chosen[path] = child
            else:
                walk(child, path)

    walk(model, "")
    return chosen


def group_blocks(blocks: list[tuple[str, int]], min_bytes: int,
                 key: Callable[[str], object] = lambda path: None) -> dict[str, list[str]]:
    """Unit name -> the block paths it joins: consecutive siblings ("parent.i", "parent.i+1") with equal `key`,
    joined until each group holds `min_bytes` ([Note: grouped blocks]). `blocks`: (path, fp32 parameter bytes) in
    module order. The planner calls this with its profile's sizes, the engine with the modules'."""
    groups: dict[str, list[str]] = {}
    run: list[str] = []
    run_bytes = 0
    for path, nbytes in blocks:
        if run:
            parent, _, index = path.rpartition(".")
            prev_parent, _, prev_index = run[-1].rpartition(".")
            follows = (parent == prev_parent and index.isdigit() and prev_index.isdigit()
                       and int(index) == int(prev_index) + 1 and key(path) == key(run[0]))
            if run_bytes >= min_bytes or not follows:
                groups[_group_name(run)] = run
                run, run_bytes = [], 0
        run.append(path)
        run_bytes += nbytes
    if run:
        groups[_group_name(run)] = run
    return groups


def _group_name(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]}-{paths[-1].rsplit('.', 1)[1]}"


def find_units(model: nn.Module, policy: UnitPolicy = None, *, min_bytes: int | None = None,
               group_key: Callable[[str], object] = lambda path: None) -> list[UnitSpec]:
    """Group `model`'s parameters into units and lay each unit out. The root unit comes first.

    min_bytes: join consecutive blocks into units of at least this many bytes of fp32 parameters; blocks whose
    `group_key(path)` differ stay apart ([Note: grouped blocks]). It applies to whichever modules `policy` chose
    (the default's blocks, or an explicit list's): only consecutive siblings of one list ("layers.3", "layers.4")
    are ever joined, so units an explicit list names apart from each other stay apart."""
    modules = _choose_modules(model, policy)
    if min_bytes:
        # Sizes as the planner sees them (its profile's units are these ungrouped specs): the same groups result.
        sizes = [(s.name, 4 * s.numel) for s in find_units(model, policy) if not s.is_root]
        members = {name: [(path, modules[path]) for path in paths]
                   for name, paths in group_blocks(sizes, min_bytes, group_key).items()}
    else:
        members = {path: [(path, module)] for path, module in modules.items()}
    chosen = {path: module for group in members.values() for path, module in group}
    unit_of_module = {path: name for name, group in members.items() for path, _ in group}
    # Which units use each parameter: a module's direct parameters belong to the innermost chosen ancestor.
    users: dict[int, set[str]] = {}
    by_id: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        owner = ROOT_UNIT
        for unit_path in chosen:
            if path == unit_path or path.startswith(unit_path + "."):
                owner = unit_of_module[unit_path]
                break
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(owner)
                by_id[id(p)] = p
    unit_of = {pid: (next(iter(u)) if len(u) == 1 else ROOT_UNIT) for pid, u in users.items()}

    specs = {ROOT_UNIT: UnitSpec(ROOT_UNIT, None)}
    specs.update({name: UnitSpec(name, group[0][1], list(group)) for name, group in members.items()})
    members: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in specs}
    for name, p in model.named_parameters():  # remove_duplicate=True: tied parameters appear once
        if not p.is_floating_point():
            raise UsageError(f"wrap: parameter {name} has dtype {p.dtype}; only floating-point parameters can be "
                             "offloaded (make it a buffer instead)")
        members[unit_of[id(p)]].append((name, p))
    for unit_name, spec in specs.items():
        ordered = [m for m in members[unit_name] if m[1].requires_grad] + \
                  [m for m in members[unit_name] if not m[1].requires_grad]
        offset = 0
        for name, p in ordered:
            offset = padded(offset)
            spec.slots.append(Slot(name, p, offset, p.shape, p.requires_grad))
            offset += p.numel()
            if p.requires_grad:
                spec.train_numel = offset
        spec.numel = padded(offset)
        spec.train_numel = padded(spec.train_numel) if spec.train_numel else 0
    # A unit with no parameters (e.g. a parameter-free block) is dropped; the root unit always stays.
    return [s for s in specs.values() if s.slots or s.is_root]


def unit_names(model: nn.Module, units: UnitPolicy = None, *, min_unit_bytes: int | None = None) -> list[str]:
    """The names of the units `tightfit.wrap(model, placement, units=units)` would make, in the order the engine
    keeps them (`ROOT_UNIT` first, then module-tree order): the names a `Placement`'s per-unit entries and
    `checkpoint_units` take. Exported as `tightfit.units`. Works on a model on the meta device (nothing is
    allocated). `min_unit_bytes`: as `Placement.min_unit_bytes`, the grouped names ("layers.0-3")."""
    return [s.name for s in find_units(model, units, min_bytes=min_unit_bytes)]


def root_modules(model: nn.Module, unit_paths: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module outside the units at `unit_paths` that holds parameters of its own: the root
    unit's embedding, final norm and head. The first of them a micro-batch calls after a unit starts the model's
    tail ([Note: the tail per micro-batch] in unit_major.py); the planner's trace finds it the same way."""
    def in_unit(path: str) -> bool:
        return any(path == u or path.startswith(u + ".") for u in unit_paths)

    return [(path, m) for path, m in model.named_modules()
            if not in_unit(path) and any(p is not None for p in m._parameters.values())]
