"""Shipping a unit's gradients off the device as soon as its backward is done, accumulating on their tier.

Why right away: a unit's `param.grad`s are device memory the next units' backward needs. When the grads tier is
addressable where the gradients are (the device tier; the host tier of a CPU device that shares host memory) they
are added in place at once. Otherwise the ship is a job ([Note: jobs and grants], runtime/host_memory.py): the
mover copies them off the device (CUDA: a device-to-host copy on its own stream) and the gradient worker finishes
them on their tier while backward goes on.

[Note: gradients land converted] Gradients with nothing to add to (the first micro-batch of a step) are the sum
itself: the mover's copy converts them to fp32 on the device and they land where the sum lives, with no host pass:
- host tier: straight into the fp32 tier tensor, which is page-locked for it (tiers/stores.py,
  `memory_model.PINNED_ENTRIES`; where the system refuses to lock more, it stays pageable and they come through a
  pack, as later micro-batches do);
- NVMe: into an fp32 pack granted at once, written to disk (or held for the step) as it is.
Why on the device: on a GPU machine the host's cores and memory are the CPU optimizer's, and a widening pass over
every gradient (6 bytes a parameter) ran beside it, while the link moves the 2 bytes more of an fp32 gradient on a
DMA engine (the second H200 run: AdamW stepped 1.72 G params/s beside the worker, 3.35 alone). On CUDA the
conversion runs on the copy's stream a bounded chunk at a time (runtime/movers.py, `CONVERT_CHUNK`), a temporary
the plan counts (memory_model.py, "grad conversion"). Where the plan finds the step waiting on the link instead
(`Placement.land_grads_fp32` False) the first micro-batch leaves in the compute dtype as the later ones do.

Later micro-batches are added to the sum on the host: the thread running backward is granted a pack in the
gradients' own dtype (half the bytes over the link) and, for NVMe, an fp32 accumulator; the gradient worker adds
the pack into the tier tensor (host tier, the upcast inside the add) or into the old sum read back into the
accumulator (NVMe), and writes the sum back. Accumulation is `old + new` in fp32, the same bits as torch's
`param.grad += new` (every bf16/fp16 value is an fp32 value, so the conversion is exact, and the add rounds once).
The worker takes each parameter's gradient norm as it adds the micro-batch a step will ask it for ([Note: norms
when asked], grad_norms.py: no second pass over the disk). When the optimizer has declared that a step follows
this backward, a unit's final accumulator goes straight to its step through the host cache instead of to disk and
back, as far as the speculative bound admits it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from tightfit.offload.memory_model import first_lands_as_sum, ship_buffers
from tightfit.offload.placement import State, Tier
from tightfit.offload.runtime.host_cache import Held, HostCache
from tightfit.offload.runtime.host_memory import Grant, HostPool
from tightfit.offload.runtime.widening import add_widening
from tightfit.offload.runtime.workers import Timers, Worker
from tightfit.offload.step.grad_norms import forget_norms, record_norms
from tightfit.offload.step.lifecycle import Event
from tightfit.offload.step.unit import GRADS, OffloadUnit
from tightfit.offload.step.units import slot_views


_NO_NORM = torch.zeros(())
"""The norm a rank records for gradients it reduced to another rank and dropped (ZeRO-2): a zero, which the norms'
exchange over the ranks (a sum, where exactly one rank holds each norm) replaces with the owner's, bit for bit."""


class GradientShipper:
    """Ships units' gradients to their tier. Collaborators: the pool that grants a ship's buffers, the mover that
    packs, the host cache that may hold the final gradients for a step, the gradient worker, the timers."""

    def __init__(self, pool: HostPool, mover, cache: HostCache, worker: Worker, timers: Timers,
                 land_fp32: bool = True) -> None:
        self.pool = pool
        self.mover = mover
        self.cache = cache
        self.worker = worker
        self.timers = timers
        self.land_fp32 = land_fp32  # Placement.land_grads_fp32: a first micro-batch's converted on the device
        # Data parallelism over the engine: starts averaging the gradients over the ranks in place on the device and
        # returns what waits for it, before they are read (tightfit/parallel/replicas.py, [Note: gradients averaged
        # as they leave]); None in one process.
        self.reduce = None

    def ship(self, unit: OffloadUnit, hold: bool, norms: bool, threads: int | None = None, final: bool = False):
        """Move the unit's new `param.grad`s (or a pass's sums of them) into its grads tier, accumulating; drop them.
        Returns the Transfer of their copy off the device while it may still read them (None when they were used up
        at once).
        hold: a step follows this backward: the final gradients may wait for it in the host cache.
        norms: take the sums' norms ([Note: norms when asked] in grad_norms.py).
        threads: the worker's intra-op threads for this job ([Note: thread budget] in workers.py; None: unchanged).
        final: these are a pass's sums, the step's whole gradients ([Note: gradient sums on the device] in unit.py):
        they leave as fp32 and their norms are taken on the device, before they leave."""
        pairs = []
        for i in sorted(unit.got):
            g = unit.take_grad(i)  # the device memory goes back as soon as the copy below has read it
            if g is not None:
                pairs.append((i, unit.trainable[i], g))
        if not pairs:
            return None
        if not unit.keeps_grads:  # ZeRO-2, another rank's unit: reduced to that rank, then dropped here
            self.reduce([g for _, _, g in pairs], unit.name)()
            for i, _, _ in pairs:
                unit.has_grad[i] = True
                unit.grad_norms[i] = _NO_NORM  # its rank's, in the norms' exchange (engine.norms_over_ranks)
            unit.life.on(Event.GRADS_STORED)
            return None
        # Averaged over the ranks before anything reads them (the norms, the sums, the steps are the group's): the
        # reduction starts now and `averaged()` waits for it, here where they are read at once, else in the copy.
        averaged = self.reduce([g for _, _, g in pairs], unit.name) if self.reduce is not None else None
        had = list(unit.has_grad)
        new = {i for i, _, _ in pairs}
        for i in new:
            unit.has_grad[i] = True
        if averaged is not None and (final and norms or "ship" not in unit.jobs):
            averaged()
            averaged = None
        if final and norms:  # taken here: the worker neither takes nor forgets them (None)
            for (i, _, _), n in zip(pairs, torch._foreach_norm([g for _, _, g in pairs], 2.0)):
                unit.grad_norms[i] = n
            norms = None
        if "ship" not in unit.jobs:  # addressable where computed: accumulate in place now (on the compute stream)
            views = unit.stored_views(State.GRADS, GRADS)
            moved = 0
            for i, _, g in pairs:
                add_widening(views[i], g) if had[i] else views[i].copy_(g)
                moved += _add_bytes(g.numel(), g.element_size(), had[i])
            moved += _norms(unit, views, new, norms)
            if unit.placement.grads != Tier.DEVICE:  # host memory, the CPU device's own: the host's cores did it
                self.timers.add("host_grad_bytes", moved)
            unit.life.on(Event.GRADS_STORED)
            return None
        slots = [((slot.offset, slot.shape), g) for _, slot, g in pairs]
        # A pass's fp32 sums always land as fp32 (a pack of the compute dtype would round them); the engine starts a
        # pass with nothing accumulated, so they are the sum.
        as_sum = not any(had) and (final or first_lands_as_sum(unit.compute_dtype.itemsize, self.land_fp32))
        target = unit.store[State.GRADS].copy_target(unit.name, GRADS) if as_sum else None
        if target is None and final and as_sum:
            # A host tier the system would not page-lock: the copy lands in it all the same (on a GPU the driver
            # stages it, and the copy does not overlap the host); NVMe has no tensor, its fp32 pack is the sum.
            target = unit.store[State.GRADS].tensor(unit.name, GRADS)
        if target is not None:  # [Note: gradients land converted]: into the host tier's sum itself
            packed = self.mover.pack_grads(slots, target, before=averaged)
            unit.life.on(Event.GRADS_SHIPPED)
            unit.grad_pending = self.worker.submit(self._landed, unit, packed, unit.grad_pending, new, norms, threads)
            return packed
        # The thread running backward holds no other grant: waiting here waits for ships and steps in flight, which
        # finish on their own ([Note: jobs and grants]).
        # Nothing to add to: an NVMe-bound fp32 pack is the sum, written (or held) as it is; pageable host gradients
        # come through a pack.
        sizes = ship_buffers(unit.jobs["ship"], as_sum, locked=False)
        grant = self.pool.reserve(f"ship grads of {unit.name}", sizes)
        packed = self.mover.pack_grads(slots, grant["pack"], before=averaged)
        unit.life.on(Event.GRADS_SHIPPED)
        unit.grad_pending = self.worker.submit(self._accumulate, unit, grant, packed, unit.grad_pending, new, had,
                                               hold, norms, threads)
        return packed

    def _wait(self, previous: Future | None, packed, t0: float) -> float:
        """Gradient worker: wait for the unit's earlier micro-batch and for this one's copy off the device, timed
        apart from the work (`grad_wait_s`; `grad_accumulate_s` is the adds, norms and writes after it: the worker
        waiting on copies is a step bound by the link, the worker adding one bound by the host's memory).
        Returns when the work starts."""
        if previous is not None:
            previous.result()  # the unit's earlier micro-batch first
        packed.done.result()
        now = time.perf_counter()
        self.timers.add("grad_wait_s", now - t0)
        return now

    def _landed(self, unit: OffloadUnit, packed, previous: Future | None, new: set[int], norms: bool,
                threads: int | None) -> None:
        """Gradient worker: gradients copied into the host tier's sum itself are there once the copy is done."""
        t0 = time.perf_counter()
        self.worker.use_threads(threads)
        try:
            t0 = self._wait(previous, packed, t0)
            self.timers.add("host_grad_bytes", _norms(unit, unit.stored_views(State.GRADS, GRADS), new, norms))
            unit.life.on(Event.GRADS_LANDED)
        finally:
            self.timers.since("grad_accumulate_s", t0)

    def _accumulate(self, unit: OffloadUnit, grant: Grant, packed, previous: Future | None, new: set[int],
                    had: list[bool], hold: bool, norms: bool, threads: int | None) -> None:
        """Gradient worker: add the packed new gradients into the unit's host or disk gradient entry."""
        t0 = time.perf_counter()
        self.worker.use_threads(threads)
        try:
            t0 = self._wait(previous, packed, t0)
            pack = grant["pack"]
            store = unit.store[State.GRADS]
            if store.tensor(unit.name, GRADS) is not None:  # host memory: the upcast happens inside the add
                views = unit.stored_views(State.GRADS, GRADS)
                moved = _add_into(unit, views, pack, new, had)
                grant.release()
                self.timers.add("host_grad_bytes", moved + _norms(unit, views, new, norms))
                unit.life.on(Event.GRADS_LANDED)
                return
            if GRADS not in grant:  # fp32, first gradients since the step: the pack is the sum
                grant.rename("pack", GRADS)
            elif any(had):
                held = self.cache.take(unit.name, GRADS, unit.version)
                if held is not None:  # the last micro-batch was declared, and was not: the old sums are here
                    grant.give(GRADS)
                    held.grant.move(GRADS, grant)
                else:
                    store.load(unit.name, GRADS, grant[GRADS]).result()
            acc = grant[GRADS]
            views = slot_views(unit.trainable, acc)  # a granted buffer: [Note: views built once] in unit.py
            moved = 0
            if "pack" in grant:
                moved = _add_into(unit, views, pack, new, had)
                grant.give("pack")
            self.timers.add("host_grad_bytes", moved + _norms(unit, views, new, norms))
            # [Note: speculative holdings]: kept for the step only as far as the pool's bound admits it.
            if hold and grant.speculate():
                self.cache.put(unit.name, GRADS, Held(grant, unit.version, only_copy=True))
                unit.life.on(Event.GRADS_HELD)
                return
            store.save(unit.name, GRADS, acc).result()
            grant.release()
            unit.life.on(Event.GRADS_LANDED)
        except BaseException:
            grant.release(after=[packed.done])
            raise
        finally:
            self.timers.since("grad_accumulate_s", t0)


def _add_into(unit: OffloadUnit, acc: list[torch.Tensor], pack: torch.Tensor, new: set[int], had: list[bool]) -> int:
    """acc += pack over the slots with new gradients (copied where the slot had none): old + new in fp32. `acc`: the
    accumulator's views, per trainable slot. Returns the bytes read and written."""
    moved = 0
    for i in new:
        slot = unit.trainable[i]
        add_widening(acc[i], slot.view(pack)) if had[i] else acc[i].copy_(slot.view(pack))
        moved += _add_bytes(slot.numel, pack.element_size(), had[i])
    return moved


def _add_bytes(numel: int, itemsize: int, had: bool) -> int:
    """Bytes an add of `numel` new gradients of `itemsize` bytes into an fp32 sum reads and writes: the new ones read
    and the sum read and written, or (nothing to add to) the new ones read and the sum written."""
    return numel * (itemsize + (8 if had else 4))


def _norms(unit: OffloadUnit, views: list[torch.Tensor], new: set[int], take: bool | None) -> int:
    """After an add: the sums' norms taken, or those of the changed slots forgotten (taken on demand), or (None) left
    as the ship took them. Returns the bytes read."""
    if take:
        return record_norms(unit, views)
    if take is not None:
        forget_norms(unit, new)
    return 0
