"""Wrap-time budget checks: refuse a placement whose budgets cannot hold one step, before anything is allocated.

Why at wrap time: a budget that is too small would otherwise surface mid-step, as a UsageError from the device
meter or as a pool `take` that waits forever. The arithmetic is the memory model's (`memory_model.py`), the same
the planner predicts with: the smallest device budget is the backward phase without prefetching (device-tier
states + the root unit + two blocks' params and gradients: two units overlap in backward, because a unit's
backward starts when its output gradient is ready, which can be before the unit after it has accumulated its last
parameter gradient); the smallest host budget is the host tier + the largest single job's buffers ([Note: jobs and
grants] in runtime/host_memory.py: a pool that holds the largest job cannot deadlock, and every budget accepted here
runs).
"""

from __future__ import annotations


from tightfit.errors import UsageError
from tightfit.offload import memory_model as mm
from tightfit.offload.step.unit import OffloadUnit
from tightfit.offload.placement import Placement, Tier
from tightfit.utils.sizes import format_size


def unit_sizes(units: dict[str, OffloadUnit]) -> list[mm.UnitSize]:
    """The memory model's view of the engine's units (flat sizes, padding included)."""
    return [u.size for u in units.values()]


def _compute_bytes(units: dict[str, OffloadUnit]) -> int:
    return next(iter(units.values())).compute_dtype.itemsize


def tier_bytes(units: dict[str, OffloadUnit], tier: Tier, separate: bool = False) -> int:
    """Bytes of every unit's states on `tier` (`separate`: mm.tier_states)."""
    return mm.tier_states(unit_sizes(units), _placement_of(units), _compute_bytes(units), separate)[tier]


def host_tier_bytes(units: dict[str, OffloadUnit], separate: bool = False) -> int:
    return tier_bytes(units, Tier.HOST, separate)


def _placement_of(units: dict[str, OffloadUnit]) -> Placement:
    """A placement with each unit's own tiers (the engine's units may be joined blocks or tiles), and whether the
    device casts their masters."""
    return Placement(units={u.name: u.placement for u in units.values()},
                     cast_on_device=any(u.casts_on_device for u in units.values()))


def largest_job(units: dict[str, OffloadUnit], separate: bool) -> tuple[int, str]:
    """(bytes, "job of unit") of the largest buffer set any job of these units is granted at once."""
    return mm.largest_job(unit_sizes(units), _placement_of(units), _compute_bytes(units), separate)


def check_budgets(units: dict[str, OffloadUnit], p: Placement, separate: bool) -> None:
    """Raise a UsageError naming what does not fit when a budget cannot hold one step of these units.
    separate: device memory apart from host memory (device_kind.py)."""
    sizes, c = unit_sizes(units), _compute_bytes(units)
    per_unit = _placement_of(units)
    if p.device_budget is not None:
        need = mm.device_minimum(sizes, per_unit, c)
        if sum(need.values()) > p.device_budget:
            raise UsageError(
                f"device budget {format_size(p.device_budget)} is too small: a step needs at least "
                f"{format_size(sum(need.values()))} (device-tier states {format_size(need['states'])}, the root "
                f"and two units computing at once {format_size(need['window'])}, their gradients "
                f"{format_size(need['grads in flight'])}: two units overlap in backward); raise --gpu-mem, move "
                "states off the device tier, or split the model into smaller units")
    if p.host_budget is not None:
        host = mm.tier_states(sizes, per_unit, c, separate)[Tier.HOST]
        work, job = mm.largest_job(sizes, per_unit, c, separate)
        if host + work > p.host_budget:
            raise UsageError(
                f"host budget {format_size(p.host_budget)} is too small: host-tier states take "
                f"{format_size(host)} and the largest job ({job}) needs {format_size(work)} of staging at "
                "once; raise --cpu-mem, place states on nvme, or use smaller units")
