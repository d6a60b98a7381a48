"""How large a unit should be when its states go to NVMe: small blocks are joined into larger units.

Why: a unit is the engine's transfer. A disk reaches its bandwidth on large requests issued together; the blocks of
a small model (7 MB each in the memory benchmark) reach it in lone bursts, and the NVMe tier moved them at ~0.75 of
the disk's sequential bandwidth, against ~0.9 for 28 MB units on the same machine (benchmarks/RESULTS.md, "Batch
H"). Joining consecutive blocks ([Note: grouped blocks] in tightfit/offload/step/units.py) buys larger transfers with
device memory (two units compute at once in backward) and staging memory (a unit's optimizer working set), so the
planner joins them only where its search still fits the budgets with the joined units (search.py).
"""

from __future__ import annotations

from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.offload.step.units import group_blocks
from tightfit.planner.model_profile import ModelProfile
from tightfit.utils.sizes import format_size

NVME_UNIT_BYTES = 24 << 20
"""fp32 parameter bytes a unit with a state on NVMe should reach (7 MB blocks join in fours: 28 MB)."""

MIN_UNITS = 4
"""Blocks are not joined into fewer units than this: a unit's fetch overlaps the compute of the units before it,
and one unit holding every block would leave nothing to overlap."""


def small_block_groups(placement: Placement, profile: ModelProfile) -> tuple[dict[str, list[str]], int] | None:
    """(unit name -> blocks it joins, the target bytes) when some block has a state on NVMe and is smaller than
    the target; None when nothing would be joined (no NVMe, blocks large enough, tiled layers, too few blocks)."""
    blocks = [u for u in profile.units if u.name != ROOT_UNIT]
    on_disk = [u for u in blocks if any(placement.of(u.name).tier(s) == Tier.NVME for s in State)]
    target = min(NVME_UNIT_BYTES, sum(4 * u.numel for u in blocks) // MIN_UNITS)
    if placement.tiled_linears or not on_disk or min(4 * u.numel for u in on_disk) >= target:
        return None
    if any(not u.stepped for u in blocks):  # optimizer states sharded by unit: each block stays its own unit
        return None
    # By size alone: the search that follows places the joined units; the engine, given the target, forms the
    # same units (its key on placement and checkpointing can only split where the joined units already end).
    groups = group_blocks([(u.name, 4 * u.numel) for u in blocks], target)
    if len(groups) == len(blocks):
        return None
    return groups, target


def joined_reason(profile: ModelProfile, groups: dict[str, list[str]], target: int) -> str:
    """The plan's line for joined blocks (`profile`: the blocks before joining)."""
    blocks = [u for u in profile.units if u.name != ROOT_UNIT]
    smallest = format_size(min(4 * u.numel for u in blocks))
    return (f"units: {len(blocks)} blocks of {smallest} joined into {len(groups)} units of at least "
            f"{format_size(target)}: larger NVMe transfers (a disk moves small ones at ~3/4 of its bandwidth)")
