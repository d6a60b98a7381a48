"""Wrap-time budget checks: refuse a placement whose budgets cannot hold one step, before anything is allocated.

Why at wrap time: a budget that is too small would otherwise surface mid-step, as a UsageError from the device
meter or as a pool `take` that waits forever. The smallest device budget the schedule can live with is the
device-tier states + the root unit + two units' params and gradients (two units overlap in backward: a unit's
backward starts when its output gradient is ready, which can be before the unit after it has accumulated its last
parameter gradient). The smallest host budget is the host tier + one unit's optimizer working set.
"""

from __future__ import annotations

import torch

from tightfit.errors import UsageError
from tightfit.offload.flat_unit import OffloadUnit
from tightfit.offload.placement import ROOT_UNIT, Placement, Tier
from tightfit.utils.sizes import format_size


def tier_bytes(units: dict[str, OffloadUnit], tier: Tier) -> int:
    """Bytes of every unit's entries on `tier`."""
    return sum(n * d.itemsize for u in units.values() for n, d in u.entries().get(tier, {}).values())


def host_tier_bytes(units: dict[str, OffloadUnit]) -> int:
    return tier_bytes(units, Tier.HOST)


def check_budgets(units: dict[str, OffloadUnit], p: Placement, device: torch.device) -> None:
    """Raise a UsageError naming what does not fit when a budget cannot hold one step of these units."""
    if p.device_budget is not None:
        fixed = tier_bytes(units, Tier.DEVICE)

        def need_of(u: OffloadUnit) -> int:  # while a unit computes its backward: params (unless resident) + grads
            return (0 if u.resident else u.compute_bytes) + u.grad_bytes

        root_bytes = need_of(units[ROOT_UNIT])
        big = max((u for u in units.values() if not u.spec.is_root), key=need_of, default=None)
        need = fixed + root_bytes + (2 * need_of(big) if big else 0)
        if need > p.device_budget:
            what = (f"; unit {big.name!r} needs {format_size(need_of(big))} while it computes, and two units "
                    "overlap in backward") if big else ""
            raise UsageError(
                f"device budget {format_size(p.device_budget)} is too small: device-tier states take "
                f"{format_size(fixed)}, the root unit {format_size(root_bytes)}{what}; raise --gpu-mem, move "
                "states off the device tier, or split the model into smaller units")
    if p.host_budget is not None:
        def staged(u: OffloadUnit) -> bool:  # does its optimizer step go through pool buffers?
            tiers = {u.placement.master, u.placement.grads, u.placement.optim}
            return Tier.NVME in tiers or (device.type == "cuda" and Tier.DEVICE in tiers and len(tiers) > 1)

        # One unit's optimizer working set (16 B/param + compute copy) must fit next to the host tier.
        work = max((u.step_bytes for u in units.values() if staged(u)), default=0)
        host = host_tier_bytes(units)
        if host + work > p.host_budget:
            raise UsageError(
                f"host budget {format_size(p.host_budget)} is too small: host-tier states take "
                f"{format_size(host)} and one unit's optimizer step needs {format_size(work)} "
                "of staging; raise --cpu-mem, place states on nvme, or use smaller units")
