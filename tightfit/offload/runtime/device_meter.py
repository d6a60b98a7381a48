"""The device budget's meter: the compute device's bytes the engine owns, counted against the budget.

Why a class of its own: every byte the engine puts on the device is charged here and nowhere else, so "does this
fit?" has one answer, and the bytes a gradient copy still reads are released only when that copy is done.

[Note: device budget] Device bytes in use = the device-tier stores (fixed at wrap) + the flat buffers of the
units materialised right now + the `param.grad`s of units in backward, from their backward's start until their
copy off the device has read them (`_packing`). A prefetch only starts when its unit fits; materialising a needed
unit first evicts prefetched units that are not in use, then waits for gradient copies still running; if it
still does not fit, that is a UsageError (engine.materialise). Activations are the model's own and are not
counted: leave headroom for them in the budget (the planner does).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from tightfit.offload.runtime.movers import Transfer

if TYPE_CHECKING:
    from tightfit.offload.tiers.stores import TierStore


class DeviceMeter:
    """Bytes in use on the device and their peak, against `budget` (None: no limit)."""

    def __init__(self, store: TierStore, budget: int | None, mover) -> None:
        self.store = store  # the device tier: its states are allocated at wrap and stay
        self.budget = budget
        self.mover = mover
        self.transient = 0  # materialised units' flat buffers + gradients not yet copied off
        self.peak = 0
        # Gradients shipped but not yet packed off the device: (bytes still charged, the pack's Transfer).
        self._packing: list[tuple[int, Transfer]] = []
        # Host waits for a device copy to complete, per phase ([Note: the mover contract] 6): none in forward.
        self.host_waits: Counter = Counter()

    @property
    def in_use(self) -> int:
        return self.store.bytes + self.transient

    @property
    def packing(self) -> bool:
        """Are gradient copies off the device still running (bytes that waiting would free)?"""
        return bool(self._packing)

    def charge(self, nbytes: int) -> None:
        self.transient += nbytes
        self.peak = max(self.peak, self.in_use)

    def uncharge(self, nbytes: int, after: Transfer | None = None) -> None:
        """Stop counting `nbytes`: now, or once `after` (the copy that still reads them) is done."""
        if after is not None and not after.done.done():
            self._packing.append((nbytes, after))
        else:
            self.transient -= nbytes

    def fits(self, nbytes: int) -> bool:
        if self.budget is None:
            return True
        self.settle()
        return self.in_use + nbytes <= self.budget

    def settle(self, wait: bool = False, phase=None) -> None:
        """Uncharge the gradients whose pack has read them (all of them, waiting, if `wait`: a host wait counted
        under `phase`)."""
        still = []
        for nbytes, pack in self._packing:
            if wait and not pack.done.done():
                self.host_waits[phase] += 1
                try:
                    self.mover.sync(pack)
                except BaseException:  # noqa: BLE001 - the gradient worker raises it
                    pass
            if pack.done.done():
                self.transient -= nbytes
            else:
                still.append((nbytes, pack))
        self._packing = still


def autocast_outside_budget(device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """What to tell a user whose autocast to a lower precision runs over fp32 compute weights (None: it does not).

    Why: autocast casts each weight for every op that uses it and saves the cast for backward, so every unit's
    weights live on the device a second time, in the low dtype, from forward to backward: memory the meter neither
    sees nor frees. The engine can hold the compute copy in that dtype itself (fp32 master kept)."""
    kind = device.type
    if compute_dtype != torch.float32 or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    if dtype == torch.float32:
        return None
    name = str(dtype).replace("torch.", "")
    return (f"autocast({name}) is on over fp32 compute weights: it keeps a {name} copy of every unit's weights "
            f"from forward to backward, outside the device budget; wrap with compute_dtype=torch.{name} (the fp32 "
            "master weights stay) and drop the autocast")
