"""One unit at run time: its flat compute buffer, where each of its states is, and its gradient bookkeeping.

Why a class per unit: every question the schedule asks ("is blocks.3 on the device yet?", "have all its
gradients arrived?") is answered by one object with an explicit `Where` per state, instead of flags spread over
parameters. The engine (engine.py) decides *when* to call `materialise`/`release`; this class does *how*.

[Note: flat buffer and storage resizing] A unit's parameters are, from wrap time on, views of one flat device
tensor `flat` (compute dtype). When the params tier is not the device, releasing the unit frees the flat's
storage (`untyped_storage().resize_(0)`) and materialising re-allocates it and copies the bytes in. The module's
parameters, and every tensor autograd saved from them during forward, are views of that same storage, so they
see the bytes again when backward re-materialises the unit; nothing is swapped on the parameters after wrap.
All writes go through `flat_io = flat.data`, which shares the storage but not autograd's version counter, so
refilling the buffer does not look like an in-place modification to backward. When the params tier *is* the
device, `flat` is the stored tensor itself and is never freed.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import Enum

import torch

from tightfit.offload.placement import State, Tier, UnitPlacement
from tightfit.offload.tiers import TierStore
from tightfit.offload.units import UnitSpec


class Where(str, Enum):
    """Where one state of one unit is right now."""

    ON_DEVICE = "on device"
    IN_HOST = "in host"
    ON_DISK = "on disk"
    IN_FLIGHT = "in flight"
    """Being copied to the device (params) or to its tier (grads)."""
    EMPTY = "empty"
    """No value yet: gradients before the first backward after a step, moments before the first step."""


AT_REST = {Tier.DEVICE: Where.ON_DEVICE, Tier.HOST: Where.IN_HOST, Tier.NVME: Where.ON_DISK}

# Entry names inside a store (also the tensor names inside a unit's safetensors file).
PARAMS, MASTER, GRADS, EXP_AVG, EXP_AVG_SQ = "params", "master", "grads", "exp_avg", "exp_avg_sq"


class OffloadUnit:
    """Run-time state of one unit. Created and owned by the engine; freed with it."""

    def __init__(self, spec: UnitSpec, placement: UnitPlacement, stores: dict[Tier, TierStore],
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.name = spec.name
        self.placement = placement
        self.compute_dtype = compute_dtype
        self.device = device
        self.store = {s: stores[placement.tier(s)] for s in State}
        # With fp32 compute and params and master on one tier, the master copy *is* the compute copy: one entry.
        self.master_entry = PARAMS if (compute_dtype == torch.float32
                                       and placement.params == placement.master) else MASTER
        self.trainable = spec.trainable  # slots with gradients, in flat order
        self.where: dict[State, Where] = {
            State.PARAMS: AT_REST[placement.params],
            State.MASTER: AT_REST[placement.master],
            State.GRADS: Where.EMPTY,
            State.OPTIM: Where.EMPTY,
        }
        self.resident = placement.params == Tier.DEVICE
        self.flat: torch.Tensor | None = None
        self.flat_io: torch.Tensor | None = None
        self.fetch: Future | None = None  # the in-flight params fetch, if any
        # [Note: master from the fetch] With fp32 compute the params *are* the master values. A backward fetch from
        # disk reads them into a staging buffer anyway; when the unit is about to be stepped, that buffer is kept
        # (`kept_master`, a pool buffer) and becomes the step's master buffer instead of reading the same bytes
        # from disk a second time. The root unit stays materialised between steps instead (`master_in_flat`): its
        # step runs in place on `flat` itself, which the next forward uses as is, and `flat_write` is that step's
        # write-back of `flat` (the storage must outlive it).
        self.kept_master: torch.Tensor | None = None
        # The other direction: a unit among the first of the next forward keeps the buffer its step just updated
        # (the new params, on their way to disk) as (buffer, its write-back); the forward fetch copies from it.
        self.fresh_params: tuple[torch.Tensor, Future] | None = None
        self.master_in_flat = False
        self.flat_write: Future | None = None
        # Gradient bookkeeping (main thread). `got` : trainable slot indices whose grad arrived in this backward.
        self.got: set[int] = set()
        self.open_calls = 0  # forward calls whose input-gradient hook has not fired yet in backward
        self.awaiting_backward = False
        self.grads_charged = 0  # device bytes counted for this backward's param.grads (see engine._charge_grads)
        # Across micro-batches until the optimizer step (or zero_grad): which slots hold an accumulated gradient.
        self.has_grad = [False] * len(self.trainable)
        # Per trainable slot, the 2-norm of its accumulated gradient (written by the grad worker; for clipping and
        # loss-scaler overflow checks) and the pending accumulation of this unit (serialises micro-batches).
        self.grad_norms: list[torch.Tensor | None] = [None] * len(self.trainable)
        self.grad_pending: Future | None = None
        # Final gradients kept in a pool buffer for a step during backward instead of written to disk (engine).
        self.held_grads: torch.Tensor | None = None
        # Master and moments loading for a step during backward, started at the unit's backward start
        # (optim_step.preload); consumed by the step thread, or returned by `discard_preload`.
        self.preloaded = None
        # Per trainable slot, Adam's step count (a float32 scalar, as torch.optim.AdamW keeps it). Host memory.
        self.steps: list[torch.Tensor | None] = [None] * len(self.trainable)

    # ---- entries ---------------------------------------------------------------------------------------------

    def entries(self) -> dict[Tier, dict[str, tuple[int, torch.dtype]]]:
        """What each tier must allocate for this unit: entry -> (numel, dtype)."""
        n, nt = self.spec.numel, self.spec.train_numel
        out: dict[Tier, dict[str, tuple[int, torch.dtype]]] = {}
        out.setdefault(self.placement.params, {})[PARAMS] = (n, self.compute_dtype)
        if self.master_entry == MASTER:
            out.setdefault(self.placement.master, {})[MASTER] = (n, torch.float32)
        if nt:
            out.setdefault(self.placement.grads, {})[GRADS] = (nt, torch.float32)
            out.setdefault(self.placement.optim, {})[EXP_AVG] = (nt, torch.float32)
            out[self.placement.optim][EXP_AVG_SQ] = (nt, torch.float32)
        return out

    @property
    def optim_bytes(self) -> int:
        """fp32 bytes of the unit's optimizer state in a step: master, gradients and the two moments."""
        return 4 * self.spec.numel + 12 * self.spec.train_numel

    @property
    def step_bytes(self) -> int:
        """Host bytes of the unit's optimizer step through pool buffers: `optim_bytes` plus the compute copy
        refreshed from the master."""
        return self.optim_bytes + self.compute_bytes

    @property
    def compute_bytes(self) -> int:
        return self.spec.numel * self.compute_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the `param.grad`s autograd produces for this unit in one backward (compute dtype)."""
        return self.spec.train_numel * self.compute_dtype.itemsize

    # ---- the flat compute buffer -----------------------------------------------------------------------------

    def bind(self) -> None:
        """Create `flat` and point every parameter of the unit at its view (once, at wrap time)."""
        if self.resident:
            self.flat = self.store[State.PARAMS].tensor(self.name, PARAMS)
        else:
            self.flat = torch.empty(self.spec.numel, dtype=self.compute_dtype, device=self.device)
        self.flat_io = self.flat.data  # shares storage, not the version counter (see the note above)
        for slot in self.spec.slots:
            slot.param.data = slot.view(self.flat)
        if not self.resident:
            self.flat.untyped_storage().resize_(0)

    def start_fetch(self, mover, keep_master: bool = False) -> None:
        """Allocate the flat buffer and start copying the params in (state IN_FLIGHT). keep_master: keep the
        staging buffer the bytes pass through as `kept_master` (see the note in __init__)."""
        self.flat.untyped_storage().resize_(self.compute_bytes)
        if self.fresh_params is not None:  # updated by the step that just ran: no disk read
            buf, write = self.fresh_params
            self.fresh_params = None
            self.fetch = mover.copy_in(buf, self.flat_io, after=write)
        else:
            self.fetch = mover.fetch(self.store[State.PARAMS], self.name, PARAMS, self.flat_io,
                                     keep_staging=keep_master)
        self.where[State.PARAMS] = Where.IN_FLIGHT

    def finish_fetch(self, mover) -> None:
        kept = mover.wait(self.fetch)
        self.fetch = None
        self.where[State.PARAMS] = Where.ON_DEVICE
        if kept is not None:
            self.kept_master = kept

    def free(self, mover) -> None:
        """Drop the device copy (params are never modified in place by compute, so nothing is written back)."""
        if self.fetch is not None:
            kept = self.fetch.result()  # a copy into the buffer must finish before its memory goes away
            self.fetch = None
            if kept is not None:  # a prefetch evicted before use: nobody will step from it
                mover.pool.give(kept)
        if self.flat_write is not None:
            self.flat_write.result()  # the write-back of a step in place reads this storage
            self.flat_write = None
        self.master_in_flat = False
        self.flat.untyped_storage().resize_(0)
        self.where[State.PARAMS] = AT_REST[self.placement.params]

    @property
    def on_device(self) -> bool:
        return self.resident or self.where[State.PARAMS] in (Where.ON_DEVICE, Where.IN_FLIGHT)

    def reset_backward(self) -> None:
        self.got.clear()
        self.open_calls = 0
        self.awaiting_backward = False
