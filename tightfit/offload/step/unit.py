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

import threading
from concurrent.futures import Future
from enum import Enum

import torch

from tightfit.offload.runtime.host_cache import Held
from tightfit.offload.placement import State, Tier, UnitPlacement
from tightfit.offload.tiers.stores import TierStore, done_future
from tightfit.offload.step.units import UnitSpec
from tightfit.utils import huge_pages


class Where(str, Enum):
    """Where one state of one unit is right now (for reports: derived from the unit's states below)."""

    ON_DEVICE = "on device"
    IN_HOST = "in host"
    ON_DISK = "on disk"
    IN_FLIGHT = "in flight"
    """Being copied to the device (params) or to its tier (grads)."""
    EMPTY = "empty"
    """No value yet: gradients before the first backward after a step, moments before the first step."""


AT_REST = {Tier.DEVICE: Where.ON_DEVICE, Tier.HOST: Where.IN_HOST, Tier.NVME: Where.ON_DISK}


class ParamsState(str, Enum):
    """The compute copy of a unit's parameters. Transitions (asserted, `OffloadUnit._params_to`):
    RELEASED -> FETCHING (start_fetch) -> READY (finish_fetch) -> RELEASED (free); FETCHING -> RELEASED (free
    cancels the copy). RESIDENT never changes: the params tier is the device and `flat` is the stored tensor."""

    RESIDENT = "resident"
    RELEASED = "released"
    FETCHING = "fetching"
    READY = "ready"


class GradsState(str, Enum):
    """A unit's accumulated gradients between two optimizer steps. Transitions (asserted, `_grads_to`):
    EMPTY | STORED | HELD -> SHIPPING (a backward's gradients leave the device; micro-batches may overlap) ->
    STORED (on their tier) or HELD (final gradients kept for the step in the host cache, host_cache.py);
    EMPTY | STORED -> STORED directly when the tier is addressable where they were computed; and any state at rest
    -> EMPTY (consumed by the step, or zero_grad)."""

    EMPTY = "empty"
    SHIPPING = "shipping"
    STORED = "stored"
    HELD = "held"


_PARAMS_MOVES = {
    ParamsState.FETCHING: {ParamsState.RELEASED},
    ParamsState.READY: {ParamsState.FETCHING},
    ParamsState.RELEASED: {ParamsState.FETCHING, ParamsState.READY},
}
_GRADS_MOVES = {
    GradsState.SHIPPING: {GradsState.EMPTY, GradsState.STORED, GradsState.HELD, GradsState.SHIPPING},
    GradsState.STORED: {GradsState.SHIPPING, GradsState.EMPTY, GradsState.STORED},
    GradsState.HELD: {GradsState.SHIPPING},
    GradsState.EMPTY: {GradsState.EMPTY, GradsState.STORED, GradsState.HELD},
}

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
        self.resident = placement.params == Tier.DEVICE
        self.params_state = ParamsState.RESIDENT if self.resident else ParamsState.RELEASED
        self.grads_state = GradsState.EMPTY
        self._shipping = 0  # gradient ships in flight (micro-batches of one unit may overlap)
        self._grads_lock = threading.Lock()  # grads_state moves on the main thread and the gradient worker
        self.moments_empty = True  # no optimizer step yet: Adam's moments start at zero, nothing to read
        self.flat: torch.Tensor | None = None
        self.flat_io: torch.Tensor | None = None
        self.fetch = None  # the Transfer filling `flat` while FETCHING (movers.py)
        # A resident unit with a separate master: the Transfer uploading its compute params refreshed by the last
        # step; the next forward's compute waits on it (engine.materialise).
        self.refresh = None
        # [Note: master from the fetch] With fp32 compute the params *are* the master values. A backward fetch from
        # disk reads them into a staging buffer anyway; when the unit is about to be stepped, that buffer is kept in
        # the engine's host cache (host_cache.py, entry "params") and becomes the step's master buffer instead of
        # reading the same bytes from disk a second time; the other way round, a step's updated params on their way
        # to disk stay there for the next forward's fetch. The root unit stays materialised between steps instead
        # (`master_in_flat`): its step runs in place on `flat` itself, which the next forward uses as is, and
        # `flat_write` is that step's write-back of `flat` (the storage must outlive it).
        self.version = 0  # +1 per optimizer step of the unit and per new values written: what cached copies hold
        self.master_in_flat = False
        self.flat_write: Future | None = None
        # Gradient bookkeeping (main thread). `got` : trainable slot indices whose grad arrived in this backward.
        self.got: set[int] = set()
        self.open_calls = 0  # forward calls whose input-gradient hook has not fired yet in backward
        self.awaiting_backward = False
        # Device bytes counted for this backward's param.grads (engine._charge_grads, charged to the DeviceMeter).
        self.grads_charged = 0
        # Across micro-batches until the optimizer step (or zero_grad): which slots hold an accumulated gradient.
        self.has_grad = [False] * len(self.trainable)
        # Per trainable slot, the 2-norm of its accumulated gradient (written by the grad worker; for clipping and
        # loss-scaler overflow checks) and the pending accumulation of this unit (serialises micro-batches).
        self.grad_norms: list[torch.Tensor | None] = [None] * len(self.trainable)
        self.grad_pending: Future | None = None
        # Per trainable slot, Adam's step count (a float32 scalar, as torch.optim.AdamW keeps it). Host memory.
        self.steps: list[torch.Tensor | None] = [None] * len(self.trainable)

    # ---- entries ---------------------------------------------------------------------------------------------

    def entries(self) -> dict[Tier, dict[str, tuple[int, torch.dtype]]]:
        """What each tier must allocate for this unit: entry -> (numel, dtype)."""
        n, nt = self.spec.numel, self.spec.train_numel
        out: dict[Tier, dict[str, tuple[int, torch.dtype]]] = {}
        out.setdefault(self.placement.params, {})[PARAMS] = (n, self.compute_dtype)
        if self.master_entry == MASTER and nt:
            out.setdefault(self.placement.master, {})[MASTER] = (nt, torch.float32)
        if nt:
            out.setdefault(self.placement.grads, {})[GRADS] = (nt, torch.float32)
            out.setdefault(self.placement.optim, {})[EXP_AVG] = (nt, torch.float32)
            out[self.placement.optim][EXP_AVG_SQ] = (nt, torch.float32)
        return out

    @property
    def master_numel(self) -> int:
        """Elements of the fp32 master a step works on. [Note: frozen parameters] A separate master (MASTER)
        covers only the trainable prefix `[0, train_numel)`: frozen parameters are kept once, in the compute dtype,
        in PARAMS, with no master, gradient or moments. When the params *are* the master (PARAMS), the step works on
        the whole flat buffer; only its prefix changes, and only that goes back to the tier ([Note: the frozen tail
        stays on its tier] in optim_step.py)."""
        return self.spec.numel if self.master_entry == PARAMS else self.spec.train_numel

    @property
    def optim_bytes(self) -> int:
        """fp32 bytes of the unit's optimizer state in a step: master, gradients and the two moments."""
        return 4 * self.master_numel + 12 * self.spec.train_numel

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

    def _params_to(self, new: ParamsState) -> None:
        assert self.params_state in _PARAMS_MOVES[new], f"{self.name}: params {self.params_state.value} -> {new.value}"
        self.params_state = new

    def grads_to(self, new: GradsState) -> None:
        """Move the gradients' state (any thread); SHIPPING counts ships in flight, the last one to land decides."""
        with self._grads_lock:
            old = self.grads_state
            if old == GradsState.SHIPPING and new != GradsState.SHIPPING:
                self._shipping -= 1
                if self._shipping:
                    return  # another micro-batch's gradients are still on their way
            assert old in _GRADS_MOVES[new], f"{self.name}: grads {old.value} -> {new.value}"
            if new == GradsState.SHIPPING:
                self._shipping += 1
            self.grads_state = new

    def start_fetch(self, mover, cache, keep_master: bool = False) -> None:
        """Allocate the flat buffer and start copying the params in: from a copy in the host cache when it holds
        this version (no disk read), else from the params tier. keep_master: keep the staging buffer the bytes pass
        through in the cache (see the note in __init__)."""
        self._params_to(ParamsState.FETCHING)
        self.flat.untyped_storage().resize_(self.compute_bytes)
        huge_pages.advise(self.flat_io)  # [Note: first touch]: the copy below is this memory's first write
        held = cache.take(self.name, PARAMS, self.version) if self.master_entry == PARAMS else None
        if held is not None:
            if held.ready is not None:  # a master preloaded for a step that did not come: its read first
                held.ready.result()
            self.fetch = mover.copy_in(held.buf, self.flat_io, after=held.reading or done_future())
        else:
            self.fetch = mover.fetch(self.store[State.PARAMS], self.name, PARAMS, self.flat_io,
                                     keep_staging=keep_master)

    def finish_fetch(self, mover, cache) -> None:
        kept = mover.wait(self.fetch)
        self.fetch = None
        self._params_to(ParamsState.READY)
        if kept is not None:
            cache.put(self.name, PARAMS, Held(kept, self.version))

    def free(self, mover) -> None:
        """Drop the device copy (params are never modified in place by compute, so nothing is written back).
        A copy still filling the buffer is cancelled first ([Note: the mover contract] 3, movers.py)."""
        if self.fetch is not None:
            mover.cancel(self.fetch)
            self.fetch = None
        if self.flat_write is not None:
            self.flat_write.result()  # the write-back of a step in place reads this storage (a disk write)
            self.flat_write = None
        self.master_in_flat = False
        self.flat.untyped_storage().resize_(0)
        self._params_to(ParamsState.RELEASED)

    @property
    def on_device(self) -> bool:
        return self.params_state != ParamsState.RELEASED

    @property
    def where(self) -> dict[State, Where]:
        """Where each state is now (derived; for reports and tests)."""
        params = {ParamsState.RESIDENT: Where.ON_DEVICE, ParamsState.READY: Where.ON_DEVICE,
                  ParamsState.FETCHING: Where.IN_FLIGHT, ParamsState.RELEASED: AT_REST[self.placement.params]}
        grads = {GradsState.EMPTY: Where.EMPTY, GradsState.SHIPPING: Where.IN_FLIGHT,
                 GradsState.STORED: AT_REST[self.placement.grads], GradsState.HELD: Where.IN_HOST}
        return {State.PARAMS: params[self.params_state], State.MASTER: AT_REST[self.placement.master],
                State.GRADS: grads[self.grads_state],
                State.OPTIM: Where.EMPTY if self.moments_empty else AT_REST[self.placement.optim]}

    def reset_backward(self) -> None:
        self.got.clear()
        self.open_calls = 0
        self.awaiting_backward = False
