"""The per-unit AdamW step over flat buffers, pipelined across units.

Why per unit: the optimizer's working set (fp32 master, gradient, two moments: 16 bytes per parameter) of the
whole model is exactly what does not fit; one unit's does. Why pipelined: for units on NVMe the step is I/O bound;
while unit k is stepped (torch's fused AdamW kernel on the CPU, which releases the GIL and uses every core), the
states of unit k+1 are being read and those of unit k-1 written back, by the NVMe engine's threads. Each unit's
step runs on the engine's step thread ([Note: steps under the next forward] in step_queue.py), which preloads the next
queued units before it.

    step thread:   [step k-1]        [step k]          [step k+1]
    disk reads:  [load k] [load k+1]        [load k+2]
    disk writes:            [write k-1]        [write k]

States that are addressable memory where the step runs (host tier; the device tier of a CPU device that shares host
memory) are stepped in place: no copy, no buffer. The others (NVMe; device-tier states of a step on the CPU) go
through the buffers of the unit's step job, granted at once when its step starts ([Note: jobs and grants],
runtime/host_memory.py); what the scheduler preloaded for it (master and moments, step/scheduler.py) or the gradient
worker held for it is taken over, the rest is granted then. The step thread holds no other grant while it waits.

The step runs where the states are: on the device when master, gradients and moments of the unit are all on the
device tier (e.g. a GPU with room), otherwise on the CPU.

Collaborators (`StepRunner`): the pool and host cache, the mover (uploads of refreshed compute params), the
write-back tracker, the scheduler (what to preload, which units the next forward reads first), the timers.

[Note: the frozen tail stays on its tier] A unit with frozen parameters (PEFT / LoRA) keeps them after its
trainable prefix `[0, train_numel)` of the flat buffer ([Note: frozen parameters], step/unit.py); a step changes
only that prefix. So what goes back to a tier of the params entry is the prefix alone (`save(..., start=0)`): a
separate master refreshes the compute copy's prefix without reading its frozen tail first, and fp32 params that
are their own master are written back prefix only, and read prefix only when the step's buffer is not to be kept
for the next forward (which needs the whole params: `engine.keeps_fresh`). The frozen tail on disk is the one
`write_master` wrote.

The math is `torch._fused_adamw_` on lists of per-parameter views (or of their parts, a span of the flat buffers
at a time: [Note: one pass in cache], step/adamw.py), with one float32 step count per parameter, exactly what
`torch.optim.AdamW(fused=True)` runs on the same tensors, so results are bitwise equal to it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from tightfit.offload.placement import State, Tier
from tightfit.offload.runtime.host_cache import Held, HostCache
from tightfit.offload.runtime.host_memory import Grant, HostPool
from tightfit.offload.runtime.workers import Timers
from tightfit.offload.step.adamw import step_unit
from tightfit.offload.step.lifecycle import Event, ParamsState
from tightfit.offload.step.scheduler import Scheduler, StepPhase
from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ, GRADS, MASTER, PARAMS, OffloadUnit
from tightfit.offload.step.units import slot_views
from tightfit.offload.step.write_backs import WriteBacks
from tightfit.utils import ranges

Work = tuple[OffloadUnit, list[tuple[dict, list[int]]]]
"""A unit and, per parameter group, the indices (into unit.trainable) of the slots to step."""

_STATE_OF = {PARAMS: State.MASTER, MASTER: State.MASTER, GRADS: State.GRADS, EXP_AVG: State.OPTIM,
             EXP_AVG_SQ: State.OPTIM}  # a step entry -> the state whose tier holds it


class _Loaded:
    """One unit's optimizer working set: entry -> 1-D tensor, the pending loads, and its step job's grant."""

    def __init__(self, unit: OffloadUnit, grant: Grant | None) -> None:
        self.unit = unit
        self.grant = grant
        self.tensors: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}  # entry -> its trainable slots' views, as `tensors`
        self.loads: list[Future] = []
        self.in_flat = False  # the master is the unit's materialised `flat` ([Note: master from the fetch])


class Multipliers:
    """The gradient multipliers of one step (loss-scale inverse, clip coefficient), each moved to a device once per
    step rather than once per unit and group (a device-to-host copy is a host sync)."""

    def __init__(self, scales: list[torch.Tensor]) -> None:
        self.scales = scales  # the optimizer's list: multipliers added before the step count
        self._on: dict[tuple[torch.device, int], list[torch.Tensor]] = {}

    def on(self, device: torch.device) -> list[torch.Tensor]:
        key = (device, len(self.scales))
        if key not in self._on:
            self._on[key] = [s.to(device) for s in self.scales]
        return self._on[key]


class StepRunner:
    """The optimizer's side of the engine: preloads, one unit's step, a whole step after backward.

    separate: device memory is apart from host memory (device_kind.py); when it is not, a unit still materialised on
    the CPU gives its master by a memcpy and the root's step runs in place on its flat buffer."""

    def __init__(self, pool: HostPool, cache: HostCache, mover, writes: WriteBacks, scheduler: Scheduler,
                 timers: Timers, device: torch.device, separate: bool) -> None:
        self.pool = pool
        self.cache = cache
        self.mover = mover
        self.writes = writes
        self.scheduler = scheduler
        self.timers = timers
        self.device = device
        self.separate = separate

    # ---- where the step's states are ------------------------------------------------------------------------------

    def step_device(self, unit: OffloadUnit) -> torch.device:
        p = unit.placement
        return self.device if p.master == p.grads == p.optim == Tier.DEVICE else torch.device("cpu")

    def steps_in_flat(self, unit: OffloadUnit) -> bool:
        """Can the root's step run in place on its materialised params? (CPU device sharing host memory, fp32
        params that are their own master: [Note: master from the fetch].)"""
        return (unit.spec.is_root and not self.separate and bool(unit.trainable) and unit.steps_here
                and unit.master_entry == PARAMS
                and unit.flat.device.type == "cpu" and not unit.resident)

    def _master_from_flat(self, unit: OffloadUnit) -> bool:
        """A unit still materialised on a CPU device that shares host memory copies its master from `flat`."""
        return (not self.separate and unit.master_entry == PARAMS and unit.params_state == ParamsState.READY
                and unit.flat.device.type == "cpu")

    def keeps_fresh(self, unit: OffloadUnit) -> bool:
        """Does the step of `unit` keep its updated params in the host cache for the next forward's fetch? Yes for
        the first units of the next forward (they are stepped last, and read again right away) whose params are
        their fp32 master and go through a buffer."""
        return (unit.master_entry == PARAMS and not unit.resident and PARAMS in unit.jobs.get("step", {})
                and unit.name in self.scheduler.first(StepPhase.FORWARD))

    # ---- preloads -------------------------------------------------------------------------------------------------

    def preload(self, unit: OffloadUnit, in_flat: bool = False) -> bool:
        """Start loading the unit's master and moments into the host cache for its coming step, as one speculative
        grant ([Note: speculative holdings]); False when the bound refused it (the scheduler stops there).
        in_flat: the step will run in place on the unit's materialised params (`steps_in_flat`): no master."""
        if not unit.trainable or "step" not in unit.jobs:
            return True
        want = {}
        for name in (unit.master_entry, EXP_AVG, EXP_AVG_SQ):
            if name not in unit.jobs["step"] or self.cache.holds(unit.name, name, unit.version):
                continue
            if name == PARAMS and (in_flat or unit.keeping_master or unit.params_state == ParamsState.KEPT_FOR_STEP):
                continue  # stepped in place, or on its way from the fetch
            want[name] = unit.jobs["step"][name]
        if not want:
            return True
        grant = self.pool.try_reserve(f"preload {unit.name}", want, speculative=True)
        if grant is None:
            return False
        for name, part in grant.split().items():
            buf, ready, prefix = part[name], None, None
            if name in (EXP_AVG, EXP_AVG_SQ) and unit.moments_empty:
                buf.zero_()
            elif name == PARAMS and self._master_from_flat(unit):
                buf.copy_(unit.flat_io)  # kept from forward for its backward: its params are the master
            elif name == PARAMS and self._prefix_only(unit):
                prefix = unit.spec.train_numel
                ready = unit.store[State.MASTER].load(unit.name, name, buf[:prefix], start=0)
            else:
                ready = unit.store[_STATE_OF[name]].load(unit.name, name, buf)
            self.cache.put(unit.name, name, Held(part, unit.version, ready=ready, prefix=prefix))
        return True

    def _prefix_only(self, unit: OffloadUnit) -> bool:
        """Does a step read only the trainable prefix of fp32 params that are their master? ([Note: the frozen tail
        stays on its tier]) Unless the buffer is to serve the next forward whole (`keeps_fresh`)."""
        return unit.spec.train_numel < unit.spec.numel and not self.keeps_fresh(unit)

    # ---- one unit ------------------------------------------------------------------------------------------------

    def _prepare(self, unit: OffloadUnit) -> _Loaded:
        """Take over what the cache holds for the unit's step, be granted the rest of its step job at once, and
        start loading what is not there yet."""
        in_flat = unit.params_state == ParamsState.KEPT_FOR_STEP
        if in_flat:
            self.cache.drop(unit.name, keep=(GRADS, EXP_AVG, EXP_AVG_SQ))
            if unit.flat_write is not None:
                unit.flat_write.result()  # the previous step's write-back still reads `flat`
        sizes = dict(unit.jobs.get("step", {}))
        if in_flat:
            sizes.pop(PARAMS, None)
        held = {}
        for name in sizes:
            h = self.cache.take(unit.name, name, unit.version) if name != "cast" else None
            if h is not None:
                held[name] = h
        grant = None
        if sizes:
            rest = {k: v for k, v in sizes.items() if k not in held}
            grant = self.pool.reserve(f"step {unit.name}", rest, adopt=[h.grant for h in held.values()])
        work = _Loaded(unit, grant)
        for h in held.values():
            work.loads += h.pending()  # a load still filling it; a write-back still reading what the step changes
        for name in (unit.master_entry, GRADS, EXP_AVG, EXP_AVG_SQ):
            state = _STATE_OF[name]
            if name == unit.master_entry and in_flat:
                work.tensors[name] = unit.flat_io
                work.views[name] = unit.flat_views()
                work.in_flat = True
                continue
            if grant is None or name not in grant:  # stepped in place on its tier
                t = unit.store[state].tensor(unit.name, name)
                work.tensors[name] = t
                work.views[name] = unit.stored_views(state, name)
                if state == State.OPTIM and unit.moments_empty:
                    t.zero_()
                continue
            buf = work.tensors[name] = grant[name]
            work.views[name] = slot_views(unit.trainable, buf)  # [Note: views built once] in unit.py
            if name in held:
                continue
            if state == State.OPTIM and unit.moments_empty:
                buf.zero_()  # torch.optim.AdamW starts its moments at zero; nothing to read
            elif name == PARAMS and self._master_from_flat(unit):
                buf.copy_(unit.flat_io)
            elif name == PARAMS and self._prefix_only(unit):
                # [Note: the frozen tail stays on its tier]: the prefix is all the step reads
                work.loads.append(unit.store[state].load(unit.name, name, buf[:unit.spec.train_numel], start=0))
            else:
                work.loads.append(unit.store[state].load(unit.name, name, buf))
        return work

    def _write_back(self, work: _Loaded) -> list[Future]:
        """Save what changed (master, moments, compute params) to its tier; return the pending writes. The grant
        goes back once they are done (a buffer kept for the next forward stays in the cache)."""
        unit, grant = work.unit, work.grant
        nt = unit.spec.train_numel  # a params entry changed only here: [Note: the frozen tail stays on its tier]
        writes: list[Future] = []
        saved: dict[str, Future] = {}
        for name in (unit.master_entry, EXP_AVG, EXP_AVG_SQ):
            if grant is None or name not in grant:
                continue
            store = unit.store[_STATE_OF[name]]
            buf = grant[name]
            saved[name] = store.save(unit.name, name, buf[:nt], start=0) if name == PARAMS else store.save(
                unit.name, name, buf)
            writes.append(saved[name])
        if work.in_flat:  # stepped in place on the materialised params: they go back to their tier from there
            unit.flat_write = unit.store[State.MASTER].save(unit.name, PARAMS, unit.flat_io[:nt], start=0)
            writes.append(unit.flat_write)
        if grant is not None and GRADS in grant:
            grant.give(GRADS)  # consumed by the step; nothing to write
        if unit.master_entry == MASTER and grant is not None and "cast" in grant:
            # A separate compute copy not addressable where the step ran: the step cast the new master into the
            # granted buffer (`_cast_to`); it goes on to the copy's tier.
            cast = grant["cast"]
            target = unit.store[State.PARAMS].tensor(unit.name, PARAMS)
            if target is not None:
                # The device copy the next forward computes with, uploaded from the granted buffer; the forward
                # waits on it (engine.materialise).
                unit.refresh = self.mover.copy_in(cast, target[:nt])
                grant.give("cast", after=unit.refresh.done)
            else:  # a tier that is not memory (NVMe): the prefix goes back, the frozen tail is untouched
                fut = unit.store[State.PARAMS].save(unit.name, PARAMS, cast, start=0)
                grant.give("cast", after=fut)
                writes.append(fut)
        if PARAMS in saved and self.keeps_fresh(unit):  # read whole, then (`_prefix_only`)
            # The next forward copies from it (host_cache.py), if the speculative bound admits it.
            part = grant.part(PARAMS)
            if part.speculate():
                self.cache.put(unit.name, PARAMS, Held(part, unit.version, reading=saved.pop(PARAMS)))
            else:
                part.release(after=saved.pop(PARAMS))
        for name, fut in saved.items():  # each buffer back as soon as its own write is done
            grant.give(name, after=fut)
        if grant is not None:
            grant.release()  # what is left: no transfer touches it (a cast's return is already arranged)
        return writes

    @staticmethod
    def _cast_to(work: _Loaded) -> torch.Tensor | None:
        """Where the step casts the new master for a separate compute copy: the step job's granted buffer, or the
        copy's tier tensor, addressable where the step runs. None: the params are their own master."""
        unit, grant = work.unit, work.grant
        if unit.master_entry != MASTER or unit.casts_on_device:  # [Note: the device casts the master] in unit.py
            return None
        if grant is not None and "cast" in grant:
            return grant["cast"]
        return unit.store[State.PARAMS].tensor(unit.name, PARAMS)

    def step_one(self, unit: OffloadUnit, groups: list[tuple[dict, list[int]]],
                 grad_scales: Multipliers) -> list[Future]:
        """Step one unit (take over or be granted its buffers, load, step, start the write-back); its gradients are
        consumed. Returns the pending writes. Runs on the step thread ([Note: steps under the next forward] in
        step_queue.py)."""
        t0 = time.perf_counter()
        work = self._prepare(unit)
        try:
            for f in work.loads:
                f.result()
        except BaseException:
            if work.grant is not None:
                work.grant.release(after=work.loads)
            raise
        t1 = time.perf_counter()
        scales = grad_scales.on(work.tensors[GRADS].device)
        with ranges.span("tightfit::adamw", unit.name):  # a profiler range (--profile), free otherwise
            step_unit(unit, work.tensors, work.views, groups, scales, self._cast_to(work))
        p = unit.placement
        if not p.master == p.grads == p.optim == Tier.DEVICE:  # a step on the host (`step_device`)
            # The host's cores read each stepped gradient once (AdamW), and read and write it per multiplier.
            stepped = sum(unit.trainable[i].numel for _, idx in groups for i in idx)
            self.timers.add("host_grad_bytes", stepped * 4 * (1 + 2 * len(scales)))
        unit.version += 1  # new values: cached copies of the old ones are stale
        t2 = time.perf_counter()
        writes = self._write_back(work)
        unit.moments_empty = False
        unit.life.on(Event.STEPPED)
        unit.clear_grads()
        self.timers.add("optimizer_s", t2 - t1)
        self.timers.add("optimizer_io_wait_s", t1 - t0)
        self.timers.since("optimizer_wall_s", t0)
        return writes
