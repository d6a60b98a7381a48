"""The per-unit AdamW step over flat buffers, pipelined across units.

Why per unit: the optimizer's working set (fp32 master, gradient, two moments: 16 bytes per parameter) of the
whole model is exactly what does not fit; one unit's does. Why pipelined: for units on NVMe the step is I/O bound;
while unit k is stepped (torch's fused AdamW kernel on the CPU, which releases the GIL and uses every core), the
states of unit k+1 are being read and those of unit k-1 written back, by the NVMe engine's threads.

    main thread:   [step k-1]        [step k]          [step k+1]
    disk reads:  [load k] [load k+1]        [load k+2]
    disk writes:            [write k-1]        [write k]

States that are addressable memory where the step runs (host tier; the device tier when the device is the CPU)
are stepped in place: no copy, no buffer. The others (NVMe; host states stepped on a GPU...) go through buffers
from the engine's pool, which bounds how far ahead the pipeline reads ([Note: staging memory], staging.py).

The step runs where the states are: on the device when master, gradients and moments of the unit are all on the
device tier (e.g. a GPU with room), otherwise on the CPU.

[Note: the frozen tail stays on its tier] A unit with frozen parameters (PEFT / LoRA) keeps them after its
trainable prefix `[0, train_numel)` of the flat buffer ([Note: frozen parameters], flat_unit.py); a step changes
only that prefix. So what goes back to a tier of the params entry is the prefix alone (`save(..., start=0)`): a
separate master refreshes the compute copy's prefix without reading its frozen tail first, and fp32 params that
are their own master are written back prefix only, and read prefix only when the step's buffer is not to be kept
for the next forward (which needs the whole params: `engine.keeps_fresh`). The frozen tail on disk is the one
`write_master` wrote.

The math is `torch._fused_adamw_` on lists of per-parameter views, with one float32 step count per parameter,
exactly what `torch.optim.AdamW(fused=True)` runs on the same tensors, so results are bitwise equal to it.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import torch

from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ, GRADS, MASTER, PARAMS, GradsState, OffloadUnit, ParamsState
from tightfit.offload.runtime.host_cache import Held
from tightfit.offload.placement import State, Tier
from tightfit.offload.tiers.stores import done_future
from tightfit.utils import ranges

Work = tuple[OffloadUnit, list[tuple[dict, list[int]]]]
"""A unit and, per parameter group, the indices (into unit.trainable) of the slots to step."""


class _Loaded:
    """One unit's optimizer working set: entry -> 1-D tensor, the pending loads, and the pool buffers lent."""

    def __init__(self, unit: OffloadUnit) -> None:
        self.unit = unit
        self.tensors: dict[str, torch.Tensor] = {}
        self.loads: list[Future] = []
        self.borrowed: dict[str, torch.Tensor] = {}  # entry -> pool buffer (written back and returned after step)
        self.in_flat = False  # the master is the unit's materialised `flat` (root, [Note: master from the fetch])


def _step_device(engine, unit: OffloadUnit) -> torch.device:
    p = unit.placement
    if p.master == p.grads == p.optim == Tier.DEVICE:
        return engine.device
    return torch.device("cpu")


def _take(engine, unit: OffloadUnit, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool buffer for `unit`'s step. When the pool is short, what the host cache holds for other units
    goes first ([Note: host cache admission]): they are stepped after this one, so waiting for them would never
    end. They load for themselves when their turn comes."""
    need = numel * dtype.itemsize
    if not engine.pool.has_room(need):
        engine.cache.evict_others(unit.name, need)
    return engine.pool.take(numel, dtype)


def _entries(unit: OffloadUnit, grads: bool = True) -> list[tuple[State, str, int]]:
    """(state, entry, numel) of what a step of the unit works on."""
    out = [(State.MASTER, unit.master_entry, unit.master_numel)]
    if grads:
        out.append((State.GRADS, GRADS, unit.spec.train_numel))
    return out + [(State.OPTIM, EXP_AVG, unit.spec.train_numel), (State.OPTIM, EXP_AVG_SQ, unit.spec.train_numel)]


def _prepare(engine, unit: OffloadUnit) -> _Loaded:
    """Find or start loading the unit's master, gradients and moments where the step runs: stepped in place where
    addressable, else from the host cache when it holds them (loaded ahead, held, kept from a fetch), else into
    pool buffers from their tier."""
    where = _step_device(engine, unit)
    work = _Loaded(unit)
    for state, entry, numel in _entries(unit):
        if state == State.MASTER and _master_in_flat(engine, unit, work):
            continue
        held = engine.cache.take(unit.name, entry, unit.version)
        if held is not None:
            work.tensors[entry] = work.borrowed[entry] = held.buf
            work.loads += held.pending()  # a load still filling it; a write-back still reading what the step changes
            continue
        if state == State.MASTER and _master_from_flat(engine, unit, work):
            continue
        store = unit.store[state]
        t = store.tensor(unit.name, entry)
        if t is not None and t.device == where:
            work.tensors[entry] = t  # stepped in place
            if state == State.OPTIM and unit.moments_empty:
                t.zero_()
            continue
        # fp32 params as the master, frozen tail: the prefix is all the step reads ([Note: the frozen tail stays
        # on its tier]), unless the buffer is to serve the next forward whole.
        prefix = entry == PARAMS and unit.spec.train_numel < numel and not engine.keeps_fresh(unit)
        buf = _take(engine, unit, unit.spec.train_numel if prefix else numel)
        work.tensors[entry] = work.borrowed[entry] = buf
        if state == State.OPTIM and unit.moments_empty:
            buf.zero_()  # torch.optim.AdamW starts its moments at zero; nothing to read
        else:
            work.loads.append(store.load(unit.name, entry, buf, start=0 if prefix else None))
    return work


def _master_in_flat(engine, unit: OffloadUnit, work: _Loaded) -> bool:
    """The root's materialised params are its master ([Note: master from the fetch], flat_unit.py): stepped in
    place there, and the next forward uses them as they are."""
    if unit.master_entry != PARAMS or not (unit.master_in_flat or engine.steps_in_flat(unit)):
        return False
    engine.cache.drop(unit.name, keep=tuple(e for _, e, _ in _entries(unit) if e != PARAMS))
    if unit.flat_write is not None:
        unit.flat_write.result()  # the previous step's write-back still reads `flat`
    work.tensors[PARAMS] = unit.flat_io
    work.in_flat = True
    return True


def _master_from_flat(engine, unit: OffloadUnit, work: _Loaded) -> bool:
    """A unit still materialised on the CPU (kept from forward for its backward) copies its master from its flat
    buffer (a memcpy) instead of reading it from its tier."""
    if (unit.master_entry != PARAMS or unit.params_state != ParamsState.READY or unit.flat.device.type != "cpu"
            or unit.store[State.MASTER].tensor(unit.name, PARAMS) is not None):
        return False
    buf = _take(engine, unit, unit.spec.numel)
    buf.copy_(unit.flat_io)
    work.tensors[PARAMS] = work.borrowed[PARAMS] = buf
    return True


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


def _step(unit: OffloadUnit, work: _Loaded, groups: list[tuple[dict, list[int]]], grad_scales: Multipliers) -> None:
    master, grads = work.tensors[unit.master_entry], work.tensors[GRADS]
    m, v = work.tensors[EXP_AVG], work.tensors[EXP_AVG_SQ]
    scales = grad_scales.on(grads.device)
    for group, idx in groups:
        slots = [unit.trainable[i] for i in idx]
        g = [s.view(grads) for s in slots]
        for scale in scales:  # loss-scale inverse, clip coefficient: torch multiplies grads the same way
            torch._foreach_mul_(g, scale)
        for i in idx:
            if unit.steps[i] is None:
                unit.steps[i] = torch.tensor(0.0, dtype=torch.float32, device=master.device)
            elif unit.steps[i].device != master.device:  # imported from a checkpoint
                unit.steps[i] = unit.steps[i].to(master.device)
        steps = [unit.steps[i] for i in idx]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_([s.view(master) for s in slots], g, [s.view(m) for s in slots],
                            [s.view(v) for s in slots], [], steps, amsgrad=False, lr=group["lr"],
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False)
    unit.version += 1  # new values: cached copies of the old ones are stale


def _write_back(engine, work: _Loaded) -> list[Future]:
    """Save what changed (master, moments, compute params) to its tier; return the pending writes."""
    unit = work.unit
    nt = unit.spec.train_numel  # a params entry changed only here: [Note: the frozen tail stays on its tier]
    writes: list[tuple[Future, torch.Tensor | None]] = []
    for state, entry in ((State.MASTER, unit.master_entry), (State.OPTIM, EXP_AVG), (State.OPTIM, EXP_AVG_SQ)):
        buf = work.borrowed.get(entry)
        if buf is None:
            continue
        if entry == PARAMS:
            fut = unit.store[state].save(unit.name, PARAMS, buf[:nt], start=0)
        else:
            fut = unit.store[state].save(unit.name, entry, buf)
        # The next forward copies from it (host_cache.py): only a buffer of the whole params will do.
        if entry == PARAMS and buf.numel() == unit.spec.numel and engine.keeps_fresh(unit):
            engine.cache.put(unit.name, PARAMS, Held(buf, unit.version, reading=fut))
            buf = None
        writes.append((fut, buf))
    if work.in_flat:  # stepped in place on the materialised params: they go back to their tier from there
        unit.flat_write = unit.store[State.MASTER].save(unit.name, PARAMS, unit.flat_io[:nt], start=0)
        writes.append((unit.flat_write, None))
    if GRADS in work.borrowed:
        engine.pool.give(work.borrowed[GRADS])  # gradients are consumed by the step; nothing to write
    if unit.master_entry == MASTER:  # separate compute copy: refresh it from the new master values
        # The master is the trainable prefix only; the frozen tail of the compute copy never changes
        # ([Note: frozen parameters] in flat_unit.py).
        master = work.tensors[MASTER]
        target = unit.store[State.PARAMS].tensor(unit.name, PARAMS)
        if target is not None and (target.device == master.device or not engine.pool.has_room(unit.compute_bytes)):
            target[:nt].copy_(master)  # one memory (the host tier; a CPU device): cast in place. Or no room: a copy
        elif target is not None:
            target = target[:nt]
            cast = _take(engine, unit, nt, unit.compute_dtype)
            cast.copy_(master)  # cast on the host, where the master is
            # The device copy the next forward computes with: uploaded asynchronously from a page-locked buffer, and
            # the forward waits on it (engine.materialise); the mover returns `cast` to the pool once copied.
            unit.refresh = engine.mover.copy_in(cast, target, after=done_future())
        else:  # a tier that is not memory (NVMe): the prefix goes back, the frozen tail is neither read nor written
            cast = _take(engine, unit, nt, unit.compute_dtype)
            cast.copy_(master)
            writes.append((unit.store[State.PARAMS].save(unit.name, PARAMS, cast, start=0), cast))
    futures = []
    for fut, buf in writes:
        if buf is not None:
            engine.pool.give_after(fut, buf)
        futures.append(fut)
    return futures


def step_one(engine, unit: OffloadUnit, groups: list[tuple[dict, list[int]]],
             grad_scales: Multipliers) -> list[Future]:
    """Step one unit (load, step, start the write-back); its gradients are consumed. Returns the pending writes.

    Used for the step that overlaps backward: called on the engine's step thread as soon as the unit's gradients
    of the last micro-batch have landed, while the main thread runs the backward of the units before it."""
    t0 = time.perf_counter()
    work = _prepare(engine, unit)
    for f in work.loads:
        f.result()
    t1 = time.perf_counter()
    with ranges.span("tightfit::adamw", unit.name):  # a profiler range (--profile), free otherwise
        _step(unit, work, groups, grad_scales)
    t2 = time.perf_counter()
    writes = _write_back(engine, work)
    unit.moments_empty = False
    unit.grads_to(GradsState.EMPTY)
    unit.has_grad = [False] * len(unit.trainable)
    unit.grad_norms = [None] * len(unit.trainable)
    engine._timers["optimizer_s"] = engine._timers.get("optimizer_s", 0.0) + t2 - t1
    engine._timers["optimizer_io_wait_s"] = engine._timers.get("optimizer_io_wait_s", 0.0) + (t1 - t0)
    return writes


def preload(engine, unit: OffloadUnit) -> None:
    """Start loading the master and moments of a unit whose backward starts now, into the host cache, for the step
    that follows.

    Main thread, at the unit's backward start: the loads then run under the backward compute. For a step during
    backward the step thread finds them done when the unit's gradients land; for a step after backward
    (`step_units`) only the gradients are left to read. Each entry only as far as the cache admits it now: the
    backward never waits for a buffer here, and the step loads for itself what was not admitted."""
    if not unit.trainable:
        return
    where = _step_device(engine, unit)
    for state, entry, numel in _entries(unit, grads=False):
        if engine.cache.holds(unit.name, entry, unit.version):
            continue
        if state == State.MASTER and unit.master_entry == PARAMS and (unit.master_in_flat
                                                                      or engine.steps_in_flat(unit)):
            continue  # stepped in place on the materialised params
        store = unit.store[state]
        t = store.tensor(unit.name, entry)
        if t is not None and t.device == where:
            continue  # stepped in place on its tier
        if not engine.cache.admit(numel * 4):
            return
        buf = engine.pool.take(numel, torch.float32)
        ready = None
        if state == State.OPTIM and unit.moments_empty:
            buf.zero_()
        elif (state == State.MASTER and unit.master_entry == PARAMS and unit.params_state == ParamsState.READY
              and unit.flat.device.type == "cpu"):
            buf.copy_(unit.flat_io)  # kept from forward for its backward: its params are the master
        else:
            ready = store.load(unit.name, entry, buf)
        engine.cache.put(unit.name, entry, Held(buf, unit.version, ready=ready))


def step_units(engine, work: list[Work], grad_scales: Multipliers) -> None:
    """One optimizer step over `work`, in order; loads of the next units overlap this unit's step.

    Read-ahead: up to `placement.prefetch_depth` units are loading while one is stepped, as far as the buffer pool
    has room (deeper read-ahead keeps more disk requests in flight, which is what a disk needs for bandwidth)."""
    t_wall = time.perf_counter()
    engine.wait_grads()
    work = [w for w in work if w[1]]
    if work:
        engine.release_all()  # a materialised copy would go stale
    io_wait = compute = 0.0
    depth = max(1, engine.placement.prefetch_depth)
    ahead: deque[_Loaded] = deque()  # prepared units, loads in flight, in `work` order
    nxt = 0  # index in `work` of the next unit to prepare

    def read_ahead(may_wait: bool) -> None:
        """Prepare units ahead. Waiting for pool buffers is allowed only when this thread holds none (`may_wait`
        and nothing prepared): the buffers still lent then belong to write-backs in flight, which return them as
        they finish. While a unit is held (prepared, or being stepped) a wait could never end."""
        nonlocal nxt
        while nxt < len(work) and len(ahead) < depth:
            unit = work[nxt][0]
            need = unit.step_bytes - engine.cache.held_bytes(unit.name)  # a preload during backward is used as is
            if (ahead or not may_wait) and not engine.pool.has_room(need):
                return
            ahead.append(_prepare(engine, unit))
            nxt += 1
    for unit, groups in work:
        read_ahead(may_wait=True)
        current = ahead.popleft()
        t0 = time.perf_counter()
        for f in current.loads:
            f.result()
        io_wait += time.perf_counter() - t0
        read_ahead(may_wait=False)  # overlaps the step of `current`, which holds its buffers until written back
        t0 = time.perf_counter()
        with ranges.span("tightfit::adamw", unit.name):  # a profiler range (--profile), free otherwise
            _step(unit, current, groups, grad_scales)
        compute += time.perf_counter() - t0
        # Tracked at once, not awaited: the tracker forgets a finished write (its future holds its source tensor)
        # and keeps the error of a failed one for `check`.
        engine.writes.add(_write_back(engine, current))
        del current
        unit.moments_empty = False
    engine.writes.check()  # a write-back failed: its entry is stale, stop here
    engine.zero_grad()
    engine._timers["optimizer_s"] = engine._timers.get("optimizer_s", 0.0) + compute
    engine._timers["optimizer_io_wait_s"] = engine._timers.get("optimizer_io_wait_s", 0.0) + io_wait
    engine._time("optimizer_wall_s", t_wall)
