"""Where each state of each unit lives: the contract between the planner and the offload engine.

Why a separate file: the planner produces a `Placement`, the engine consumes one, tests and users can write one by
hand. Neither side imports the other; both import this.

Vocabulary:
- a *unit* is a group of parameters moved together (a transformer block, or the leftover "root" parameters);
  units are named by their module path (e.g. "blocks.3"), the leftovers by `ROOT_UNIT`;
- a unit has four *states*: compute parameters (the dtype the forward runs in), the fp32 master copy, gradients,
  and optimizer moments (Adam's exp_avg and exp_avg_sq);
- each state of each unit lives on one *tier*: the device (CUDA memory; on a CPU-only machine the CPU itself with
  a byte budget), host memory (pinned on CUDA), or NVMe (safetensors files in a swap folder).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

ROOT_UNIT = "root"
"""Name of the unit holding every parameter that belongs to no repeated block (embeddings, final norm, head)."""


class Tier(str, Enum):
    """A memory tier, fastest first."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class State(str, Enum):
    """The per-unit training states the planner places independently."""

    PARAMS = "params"
    MASTER = "master"
    GRADS = "grads"
    OPTIM = "optim"


@dataclass(frozen=True)
class UnitPlacement:
    """Tier of each state of one unit."""

    params: Tier = Tier.DEVICE
    """Compute parameters between uses (they are always brought to the device to compute)."""
    master: Tier = Tier.DEVICE
    """fp32 master weights (the same tensor as params when compute is fp32 and both share a tier)."""
    grads: Tier = Tier.DEVICE
    """Accumulated gradients, kept until the optimizer step."""
    optim: Tier = Tier.DEVICE
    """Optimizer moments (Adam exp_avg, exp_avg_sq)."""

    def tier(self, state: State) -> Tier:
        return getattr(self, state.value)

    @classmethod
    def all_on(cls, tier: Tier) -> "UnitPlacement":
        return cls(tier, tier, tier, tier)

    def to_dict(self) -> dict[str, str]:
        return {s.value: self.tier(s).value for s in State}

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> "UnitPlacement":
        return cls(**{s.value: Tier(d.get(s.value, Tier.DEVICE.value)) for s in State})


def _group_of(block: str, names) -> str | None:
    """The name among `names` of a group of blocks ("blocks.0-3", units.py) that contains `block` ("blocks.2")."""
    parent, _, index = block.rpartition(".")
    if not index.isdigit():
        return None
    for name in names:
        head, _, span = name.rpartition(".")
        first, dash, last = span.partition("-")
        if dash and head == parent and first.isdigit() and last.isdigit() and int(first) <= int(index) <= int(last):
            return name
    return None


def _named(unit: str, names: set[str]) -> bool:
    """Is `unit` one of `names`, in a group among them, or a part (a tile) of one of them?"""
    return (unit in names or _group_of(unit, names) is not None
            or any(unit.startswith(name + ".") for name in names))


_RETIRED = ("nvme_threads", "nvme_chunk_bytes", "staging_buffers")
"""Fields older plan files carry and `from_dict` skips: the disk's tuning is the probe's now ([Note: disk tuning] in
nvme/tuning.py), and staging buffers were never read."""


@dataclass
class Placement:
    """A complete placement: per-unit tiers, budgets and schedule knobs. JSON round-trips."""

    default: UnitPlacement = field(default_factory=UnitPlacement)
    """Placement of every unit not named in `units`."""
    units: dict[str, UnitPlacement] = field(default_factory=dict)
    """Per-unit overrides, keyed by unit name."""
    device_budget: int | None = None
    """Bytes the engine may hold on the device tier (None: no limit)."""
    host_budget: int | None = None
    """Bytes of host memory for tier storage and staging (None: no limit)."""
    nvme_dir: str | None = None
    """Swap folder for the NVMe tier; required when any state is placed on NVMe."""
    nvme_budget: int | None = None
    """Bytes the swap folder may use (None: its free space)."""
    prefetch_depth: int = 2
    """How many units ahead of the running one are fetched."""
    min_unit_bytes: int | None = None
    """Join consecutive blocks into units of at least this many bytes of fp32 parameters (None: one block per
    unit). Larger units are larger disk transfers, at the cost of device room for two of them ([Note: grouped
    blocks] in units.py)."""
    checkpoint_units: list[str] = field(default_factory=list)
    """Units whose activations are recomputed in backward instead of stored."""
    tiled_linears: dict[str, int] = field(default_factory=dict)
    """Linear modules to replace by tiles before wrapping: module path -> number of tiles."""
    land_grads_fp32: bool = True
    """A step's first gradients leave the device converted to fp32 and land as their sum, with no host pass (4 bytes a
    parameter over the link: [Note: gradients land converted] in step/gradients.py); False: in the compute dtype,
    widened on the host (2 bytes over the link, 6 over host memory). The planner takes the faster."""
    cast_on_device: bool = False
    """Units whose params and master are both on the host tier, all of their parameters trainable, in a compute dtype
    narrower than fp32, keep no compute copy there: a fetch uploads the fp32 master and the device casts it ([Note:
    the device casts the master] in step/unit.py). 4 bytes a parameter over the link per fetch instead of 2, and
    the CPU's step no longer casts (6 bytes a parameter over host memory) nor holds the copy (2 bytes a parameter
    of page-locked memory; the master is page-locked instead). The planner takes the faster."""
    stepped_elsewhere: list[str] = field(default_factory=list)
    """Units another rank steps ([Note: optimizer states sharded by unit] in tightfit/parallel/sharded_optimizer.py):
    this process holds no fp32 master (beyond fp32 params that are their own) and no moments for them, averages
    their gradients like any other's (or, with `grads_elsewhere`, reduces them to their rank and keeps none), and is
    sent their new values after each step (or, where they are `exchanged`, for each use). Block names; a group or a
    tile of one of them is stepped elsewhere too."""
    grads_elsewhere: bool = False
    """ZeRO-2: the gradients of the units stepped elsewhere are reduced to the rank that steps them as they leave the
    device; none of them lands here."""
    exchanged: list[str] = field(default_factory=list)
    """ZeRO-3: the units one rank owns (block names; their groups and tiles too). Each use of their params on every
    rank comes from that rank, sent for that use ([Note: parameters sent for each use] in
    tightfit/parallel/params_exchange.py); a unit stepped elsewhere then keeps no params here either."""

    def of(self, unit: str) -> UnitPlacement:
        """The tiers of `unit`, or of the group that contains it ("blocks.2" is in "blocks.0-3")."""
        return self.units.get(unit) or self.units.get(_group_of(unit, self.units), self.default)

    def checkpoints(self, unit: str) -> bool:
        """`unit` (or the group that contains it) is recomputed in backward."""
        return unit in self.checkpoint_units or _group_of(unit, self.checkpoint_units) is not None

    def steps_here(self, unit: str) -> bool:
        """Does this process step `unit` (or the group or block that contains it)? ([Note: optimizer states sharded
        by unit])"""
        if not self.stepped_elsewhere:
            return True
        return not _named(unit, set(self.stepped_elsewhere))

    def is_exchanged(self, unit: str) -> bool:
        """Do `unit`'s params come through the exchange for each use (ZeRO-3)?"""
        return bool(self.exchanged) and _named(unit, set(self.exchanged))

    def holds_params(self, unit: str) -> bool:
        """Does this process keep `unit`'s compute params? (All but, under ZeRO-3, another rank's units'.)"""
        return not self.is_exchanged(unit) or self.steps_here(unit)

    def keeps_grads(self, unit: str) -> bool:
        """Are `unit`'s gradients summed in this process? (All but, under ZeRO-2, another rank's units'.)"""
        return not self.grads_elsewhere or self.steps_here(unit)

    def uses(self, tier: Tier) -> bool:
        return any(p.tier(s) == tier for p in [self.default, *self.units.values()] for s in State)

    @classmethod
    def everywhere(cls, tier: Tier | str, **kwargs) -> "Placement":
        """Every state of every unit on one tier."""
        return cls(default=UnitPlacement.all_on(Tier(tier)), **kwargs)

    def with_units(self, **overrides: UnitPlacement) -> "Placement":
        return replace(self, units={**self.units, **overrides})

    def for_units(self, names: list[str]) -> "Placement":
        """This placement re-expressed for a finer set of units (e.g. after tiling made each tile a unit).

        Each unit inherits the tiers of the planned unit that contains it ("blocks.0.mlp.up.tiles.3" takes those
        of "blocks.0"); a planned unit that is no longer a unit drops out, and so does its activation
        checkpointing (recomputation works per unit).
        """
        def owner(name: str) -> str | None:
            found = [u for u in self.units if name == u or name.startswith(u + ".")]
            return max(found, key=len) if found else None

        units = {n: self.units[o] for n in names if (o := owner(n)) is not None}
        return replace(self, units=units, checkpoint_units=[u for u in self.checkpoint_units if u in names],
                       stepped_elsewhere=[n for n in names if not self.steps_here(n)],
                       exchanged=[n for n in names if self.is_exchanged(n)])

    def for_groups(self, groups: dict[str, list[str]]) -> "Placement":
        """This placement re-expressed for coarser units: `groups` maps a unit name to the names of the blocks it
        joins, which share their tiers and checkpointing (units.py keeps blocks apart that do not)."""
        units, checkpointed = dict(self.units), set(self.checkpoint_units)
        elsewhere, exchanged = set(self.stepped_elsewhere), set(self.exchanged)
        for name, members in groups.items():
            if members == [name]:
                continue
            first = members[0]
            if first in units:
                units[name] = units[first]
            if first in checkpointed:
                checkpointed.add(name)
            if first in elsewhere:
                elsewhere.add(name)
            if first in exchanged:
                exchanged.add(name)
            for m in members:
                units.pop(m, None)
                checkpointed.discard(m)
                elsewhere.discard(m)
                exchanged.discard(m)
        return replace(self, units=units, checkpoint_units=sorted(checkpointed), stepped_elsewhere=sorted(elsewhere),
                       exchanged=sorted(exchanged))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["default"] = self.default.to_dict()
        d["units"] = {k: v.to_dict() for k, v in self.units.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        d = {k: v for k, v in d.items() if k not in _RETIRED}
        d["default"] = UnitPlacement.from_dict(d.get("default", {}))
        d["units"] = {k: UnitPlacement.from_dict(v) for k, v in d.get("units", {}).items()}
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        return cls.from_dict(json.loads(text))
