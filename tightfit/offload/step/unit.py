"""One unit at run time: its flat compute buffer, its lifecycle, its jobs' buffer sets and its gradient bookkeeping.

Why a class per unit: every question the schedule asks ("is blocks.3 on the device yet?", "have all its
gradients arrived?") is answered by one object: its three states are its `Lifecycle` (lifecycle.py), the rest is
data. The engine (engine.py) decides *when* a unit moves; this class does *how* its flat buffer is filled and freed.

[Note: flat buffer and storage resizing] A unit's parameters are, from wrap time on, views of one flat device
tensor `flat` (compute dtype). When the params tier is not the device, releasing the unit frees the flat's
storage (`untyped_storage().resize_(0)`) and materialising re-allocates it and copies the bytes in. The module's
parameters, and every tensor autograd saved from them during forward, are views of that same storage, so they
see the bytes again when backward re-materialises the unit; nothing is swapped on the parameters after wrap.
All writes go through `flat_io = flat.data`, which shares the storage but not autograd's version counter, so
refilling the buffer does not look like an in-place modification to backward. When the params tier *is* the
device, `flat` is the stored tensor itself and is never freed.

[Note: master from the fetch] With fp32 compute the params *are* the master values. A backward fetch from disk
reads them into a staging buffer anyway; when the unit's step follows, that buffer is kept in the host cache
(runtime/host_cache.py, entry "params") and becomes the step's master buffer instead of reading the same bytes
from disk a second time; the other way round, a step's updated params on their way to disk stay there for the next
forward's fetch. On a CPU device that shares host memory, the root unit stays materialised between steps instead
(`ParamsState.KEPT_FOR_STEP`): its step runs in place on `flat` itself, which the next forward uses as is, and
`flat_write` is that step's write-back of `flat` (the storage must outlive it).

[Note: the device casts the master] (`Placement.cast_on_device`, `memory_model.casts_on_device`) A unit whose
params and fp32 master are both on the host tier, every parameter trainable, with a narrower compute dtype, may keep
no compute copy on the host: a fetch uploads the master (page-locked for it, `locked`) and the device casts it, the
mover a chunk at a time (runtime/movers.py). What that saves is the CPU step's cast into the compute copy (6 bytes
a parameter over host memory, beside AdamW on the same cores) and the copy itself; what it costs is 2 bytes a
parameter more over the link per fetch. FSDP2's CPU offload works this way (fp32 sharded params on the host, cast
to `param_dtype` after the copy). The step writes the master in place while no copy reads it: the unit's last
upload before its step was waited on by its backward, whose gradients the step waits for; the next forward's fetch
comes after the step (the same order the host compute copy had). Its compute-dtype values, where something asks
for them outside a fetch, are the master cast (`read_params`).

[Note: gradient sums on the device] In a unit-major pass (step/unit_major.py) a unit computes all M micro-batches of
a step back to back, so its gradients are summed where they are computed and leave the device once, as the step's
sum: no host pass adds micro-batches. With fp32 compute that sum is autograd's own `param.grad`, which it
accumulates by `grad += new` in fp32: the host's `old + new`, the same bits. A narrower compute dtype would
accumulate in that dtype; there each micro-batch's `param.grad` is folded, as it accumulates, into an fp32 sum on
the device (`device_sums`, `fold_grad`: the first copied exactly, the next added in fp32, the host's upcast inside
its add) and dropped. The sums leave as fp32 ([Note: gradients land converted] in gradients.py: into the host tier's
sum itself, or an fp32 pack bound for NVMe), their norms taken on the device first. The device holds, per unit in
backward, its fp32 sums and one micro-batch's gradients (`sum_bytes`, charged by the engine): two units' at once,
as GreedySnake's two unit-sized buffers.

[Note: views built once] A step, a gradient ship and a norm each work on per-parameter views of a unit's flat
tensors, and building a view is a host-side call that costs more than a small parameter's kernels (on the CPU,
0.2 ms per unit and step for a 12-parameter block: benchmarks/RESULTS.md, batch U). The views of a tensor that
lives as long as the unit are built once and kept: a memory tier's stored entries (freed only when the engine
closes, with its units) and `flat_io` (its storage is resized, never replaced, so a view made before a release sees
the bytes of the next fetch, as the parameters do). A buffer granted for one job gets new views each time: keeping
them would keep the pool's memory referenced after the grant went back.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import Enum

import torch
from torch._C import DisableTorchFunctionSubclass

from tightfit.offload.memory_model import (
    PINNED_ENTRIES,
    UnitSize,
    casts_on_device,
    host_addressable,
    unit_jobs,
)
from tightfit.offload.placement import State, Tier, UnitPlacement
from tightfit.offload.runtime.host_memory import Sizes
from tightfit.offload.runtime.widening import add_widening
from tightfit.offload.step.lifecycle import Event, GradsState, Lifecycle, ParamsState
from tightfit.offload.step.units import UnitSpec, slot_views
from tightfit.offload.tiers.stores import TierStore
from tightfit.utils import huge_pages


class Where(str, Enum):
    """Where one state of one unit is right now (for reports: derived from the unit's lifecycle)."""

    ON_DEVICE = "on device"
    IN_HOST = "in host"
    ON_DISK = "on disk"
    IN_FLIGHT = "in flight"
    """Being copied to the device (params) or to its tier (grads)."""
    EMPTY = "empty"
    """No value yet: gradients before the first backward after a step, moments before the first step."""


AT_REST = {Tier.DEVICE: Where.ON_DEVICE, Tier.HOST: Where.IN_HOST, Tier.NVME: Where.ON_DISK}

# Entry names inside a store (also the tensor names inside a unit's safetensors file, and the names of a step job's
# buffers).
PARAMS, MASTER, GRADS, EXP_AVG, EXP_AVG_SQ = "params", "master", "grads", "exp_avg", "exp_avg_sq"
FLAT_VIEWS = "flat"  # the key of `flat_io`'s views among a unit's kept views (not a stored entry)


class OffloadUnit:
    """Run-time state of one unit. Created and owned by the engine; freed with it.

    separate: device memory is apart from host memory (device_kind.py): what the CPU may work on in place."""

    def __init__(self, spec: UnitSpec, placement: UnitPlacement, stores: dict[Tier, TierStore],
                 compute_dtype: torch.dtype, device: torch.device, separate: bool,
                 cast_on_device: bool = False, steps_here: bool = True, keeps_grads: bool = True,
                 holds_params: bool = True, exchanged: bool = False) -> None:
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
        # False: another rank steps the unit and sends its values; no master (beyond fp32 params that are their own)
        # and no moments here ([Note: optimizer states sharded by unit] in tightfit/parallel/sharded_optimizer.py).
        self.steps_here = steps_here
        # False (ZeRO-2): its gradients are reduced to the rank that steps it as they leave the device, none lands here
        self.keeps_grads = keeps_grads
        # False (ZeRO-3): its owner holds its compute params and sends them for each use; `exchanged`: every use of
        # them, on every rank, comes through the exchange ([Note: parameters sent for each use] in
        # tightfit/parallel/params_exchange.py)
        self.holds_params, self.exchanged = holds_params, exchanged
        self.size = UnitSize(self.name, spec.numel, spec.train_numel, steps_here, keeps_grads, holds_params, exchanged)
        # [Note: the device casts the master]: no compute copy at rest, the master uploaded and cast by the device.
        self.casts_on_device = casts_on_device(self.size, placement, compute_dtype.itemsize, cast_on_device)
        self.resident = placement.params == Tier.DEVICE and holds_params
        self.life = Lifecycle(self.name, self.resident)
        # States the CPU works on in place (no pool buffer): [Note: jobs and grants] in host_memory.py.
        self.in_place = {s: host_addressable(placement.tier(s), separate) for s in State}
        # Each job's buffer set ([Note: jobs and grants]), from the one function that also sizes the pool.
        dtype = {compute_dtype.itemsize: compute_dtype, 4: torch.float32}  # bytes per element -> dtype
        self.jobs: dict[str, Sizes] = {
            job: {name: (numel, dtype[e]) for name, (numel, e) in bufs.items()}
            for job, bufs in unit_jobs(self.size, placement, compute_dtype.itemsize, separate).items()}
        self.moments_empty = True  # no optimizer step yet: Adam's moments start at zero, nothing to read
        self.flat: torch.Tensor | None = None
        self.flat_io: torch.Tensor | None = None
        self.fetch = None  # the Transfer filling `flat` while FETCHING (movers.py)
        # A resident unit with a separate master: the Transfer uploading its compute params refreshed by the last
        # step; the next forward's compute waits on it (engine.materialise).
        self.refresh = None
        self.version = 0  # +1 per optimizer step of the unit and per new values written: what cached copies hold
        self.flat_write: Future | None = None  # a step in place's write-back of `flat` ([Note: master from ...])
        # The unit's optimizer step, queued or running on the step thread, until someone waited for it: what uses the
        # unit's states waits first (engine.wait_step, [Note: steps under the next forward] in step_queue.py).
        self.stepping: Future | None = None
        self.keeping_master = False  # a fetch's staging buffer is on its way to the host cache as the master
        # Backward bookkeeping (the thread running backward): trainable slot indices whose grad arrived in this
        # backward, and forward calls whose input-gradient hook has not fired yet.
        self.got: set[int] = set()
        self.open_calls = 0
        # Across micro-batches until the optimizer step (or zero_grad): which slots hold an accumulated gradient.
        self.has_grad = [False] * len(self.trainable)
        # Per trainable slot, the 2-norm of its accumulated gradient (written by the grad worker; for clipping and
        # loss-scaler overflow checks) and the pending accumulation of this unit (serialises micro-batches).
        self.grad_norms: list[torch.Tensor | None] = [None] * len(self.trainable)
        self.grad_pending: Future | None = None
        # Per trainable slot, its gradient summed over a pass's micro-batches in fp32 on the device, until it leaves
        # ([Note: gradient sums on the device]); None outside a pass's backward.
        self.device_sums: list[torch.Tensor | None] = [None] * len(self.trainable)
        # Per trainable slot, Adam's step count (a float32 scalar, as torch.optim.AdamW keeps it). Host memory.
        self.steps: list[torch.Tensor | None] = [None] * len(self.trainable)
        # [Note: views built once]: entry (or FLAT_VIEWS) -> the trainable slots' views of it.
        self._views: dict[str, list[torch.Tensor]] = {}

    # ---- entries ---------------------------------------------------------------------------------------------

    def entries(self) -> dict[Tier, dict[str, tuple[int, torch.dtype]]]:
        """What each tier must allocate for this unit: entry -> (numel, dtype)."""
        n, nt = self.spec.numel, self.spec.train_numel
        out: dict[Tier, dict[str, tuple[int, torch.dtype]]] = {}
        if not self.casts_on_device and self.holds_params:
            out.setdefault(self.placement.params, {})[PARAMS] = (n, self.compute_dtype)
        if self.master_entry == MASTER and nt and self.steps_here:
            out.setdefault(self.placement.master, {})[MASTER] = (nt, torch.float32)
        if nt and self.keeps_grads:
            out.setdefault(self.placement.grads, {})[GRADS] = (nt, torch.float32)
        if nt and self.steps_here:
            out.setdefault(self.placement.optim, {})[EXP_AVG] = (nt, torch.float32)
            out[self.placement.optim][EXP_AVG_SQ] = (nt, torch.float32)
        return out

    @property
    def locked(self) -> tuple[str, ...]:
        """The host tier's entries of this unit a GPU copies asynchronously (page-locked: stores.MemoryStore)."""
        return (*PINNED_ENTRIES, MASTER) if self.casts_on_device else PINNED_ENTRIES

    def params_source(self) -> tuple[TierStore, str]:
        """(store, entry) the compute copy is fetched from: the params, or the fp32 master the device casts."""
        if self.casts_on_device:
            return self.store[State.MASTER], MASTER
        return self.store[State.PARAMS], PARAMS

    def read_params(self, out: torch.Tensor) -> None:
        """The compute copy's values into `out` (a host tensor of the unit's flat size, compute dtype), from its tier
        or cast from the master."""
        store, entry = self.params_source()
        if entry == PARAMS:
            store.load(self.name, PARAMS, out).result()
            return
        master = torch.empty(self.spec.numel, dtype=torch.float32)
        store.load(self.name, MASTER, master).result()
        out.copy_(master)

    @property
    def master_numel(self) -> int:
        """Elements of the fp32 master a step works on. [Note: frozen parameters] A separate master (MASTER)
        covers only the trainable prefix `[0, train_numel)`: frozen parameters are kept once, in the compute dtype,
        in PARAMS, with no master, gradient or moments. When the params *are* the master (PARAMS), the step works on
        the whole flat buffer; only its prefix changes, and only that goes back to the tier ([Note: the frozen tail
        stays on its tier] in optimizer.py). A unit another rank steps has no separate master here: 0."""
        if self.master_entry == PARAMS:
            return self.spec.numel
        return self.spec.train_numel if self.steps_here else 0

    @property
    def compute_bytes(self) -> int:
        return self.spec.numel * self.compute_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the `param.grad`s autograd produces for this unit in one backward (compute dtype)."""
        return self.spec.train_numel * self.compute_dtype.itemsize

    @property
    def sum_bytes(self) -> int:
        """Bytes of the fp32 gradient sums a pass keeps on the device ([Note: gradient sums on the device])."""
        return self.spec.train_numel * 4

    def fold_grad(self, i: int) -> None:
        """Fold slot `i`'s `param.grad` into its fp32 sum on the device and drop it ([Note: gradient sums on the
        device]); the thread running backward, right after autograd accumulated it."""
        param = self.trainable[i].param
        with DisableTorchFunctionSubclass():  # plain attribute access: the wrapped parameter's class is not asked
            g = param.grad
            if g is None:
                return
            param.grad = None
        s = self.device_sums[i]
        if s is None:
            self.device_sums[i] = g.to(torch.float32, copy=True)
        else:
            add_widening(s, g)

    def take_grad(self, i: int) -> torch.Tensor | None:
        """Slot `i`'s gradient of this backward (its sum on the device, or autograd's `param.grad`), handed over:
        neither is kept."""
        param = self.trainable[i].param
        with DisableTorchFunctionSubclass():
            g = param.grad
            param.grad = None
        if self.device_sums[i] is not None:
            g, self.device_sums[i] = self.device_sums[i], None
        return g

    def stored_views(self, state: State, entry: str) -> list[torch.Tensor]:
        """The trainable slots' views of the unit's `entry` as its `state`'s tier stores it (an addressable tier's
        own tensor: the caller knows it is one). [Note: views built once]"""
        return self._kept(entry, lambda: self.store[state].tensor(self.name, entry))

    def flat_views(self) -> list[torch.Tensor]:
        """The trainable slots' views of `flat_io` (a step in place on the materialised params). [Note: views built
        once]"""
        return self._kept(FLAT_VIEWS, lambda: self.flat_io)

    def _kept(self, key: str, tensor) -> list[torch.Tensor]:
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = slot_views(self.trainable, tensor())
        return views

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

    def start_fetch(self, mover, staging: torch.Tensor | None = None, source: torch.Tensor | None = None) -> None:
        """Allocate the flat buffer and start copying the params in: from `source` (a granted host buffer that holds
        this version), else from the params tier (through `staging` when the tier is not memory)."""
        self.life.on(Event.FETCH)
        self.flat.untyped_storage().resize_(self.compute_bytes)
        huge_pages.advise(self.flat_io)  # [Note: first touch]: the copy below is this memory's first write
        if source is not None:
            self.fetch = mover.copy_in(source, self.flat_io)
        else:
            store, entry = self.params_source()
            self.fetch = mover.fetch(store, self.name, entry, self.flat_io, staging)

    def finish_fetch(self, mover) -> None:
        mover.wait(self.fetch)
        self.fetch = None
        self.life.on(Event.FETCHED)

    def free(self, mover) -> None:
        """Drop the device copy (params are never modified in place by compute, so nothing is written back).
        A copy still filling the buffer is cancelled first ([Note: the mover contract] 3, movers.py)."""
        if self.fetch is not None:
            mover.cancel(self.fetch)
            self.fetch = None
        if self.flat_write is not None:
            self.flat_write.result()  # the write-back of a step in place reads this storage (a disk write)
            self.flat_write = None
        self.flat.untyped_storage().resize_(0)
        self.life.on(Event.EVICT)

    @property
    def params_state(self) -> ParamsState:
        return self.life.params

    @property
    def grads_state(self) -> GradsState:
        return self.life.grads

    @property
    def on_device(self) -> bool:
        return self.life.on_device

    @property
    def where(self) -> dict[State, Where]:
        """Where each state is now (derived; for reports and tests)."""
        params = {ParamsState.RESIDENT: Where.ON_DEVICE, ParamsState.READY: Where.ON_DEVICE,
                  ParamsState.KEPT_FOR_STEP: Where.ON_DEVICE, ParamsState.FETCHING: Where.IN_FLIGHT,
                  ParamsState.RELEASED: AT_REST[self.placement.params]}
        grads = {GradsState.EMPTY: Where.EMPTY, GradsState.SHIPPING: Where.IN_FLIGHT,
                 GradsState.STORED: AT_REST[self.placement.grads], GradsState.HELD: Where.IN_HOST}
        return {State.PARAMS: params[self.life.params], State.MASTER: AT_REST[self.placement.master],
                State.GRADS: grads[self.life.grads],
                State.OPTIM: Where.EMPTY if self.moments_empty else AT_REST[self.placement.optim]}

    def clear_grads(self) -> None:
        """The accumulated gradients are gone (consumed by a step, or dropped)."""
        self.has_grad = [False] * len(self.trainable)
        self.grad_norms = [None] * len(self.trainable)
