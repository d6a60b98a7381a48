"""The offload engine: owns the units, the tier stores, the mover and the workers, and reacts to the hooks' events.

Why one object: everything that must agree about a step (which units are on the device, how many device bytes are
in use, which gradients are still travelling) lives here, so the invariants are checked in one place. It is
found through `engine_of(model)` / `engine_of_param(p)`, two weak registries keyed by object identity: nothing is
attached to the model's parameters.

The engine turns hook events into lifecycle events (lifecycle.py) and asks the scheduler (scheduler.py) what to move
ahead; the work itself is done by collaborators it builds and hands what they need: the gradient shipper
(gradients.py), the step runner (optimizer.py), the mover and the host pool (runtime/). Life of a unit's params in
one step (docs/ENGINE.md draws it):
  forward start    -> materialise (wait for the prefetch, or fetch now); the scheduler's moves for the next units
  forward end      -> release (storage freed; autograd's saved views stay valid, see unit.py's note), unless the
                      unit is among the first `depth` of the coming backward (it stays, idle)
  backward start   -> materialise again; the scheduler's moves (fetches; preloads when a step follows)
  grads complete   -> ship the gradients to the grads tier (accumulating), release; a step during backward starts
  end of backward  -> finish whatever the per-unit events did not (unused parameters, frozen units)
The root unit is materialised from the model's forward start until its gradients are complete.

The device budget is metered by `DeviceMeter` (runtime/device_meter.py, [Note: device budget]); host buffers are
granted per job by the pool ([Note: jobs and grants], runtime/host_memory.py).

A unit's optimizer step runs on the step thread, queued and waited for by `StepQueue` ([Note: steps under the
next forward], step_queue.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from tightfit.errors import UsageError
from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.offload.runtime.device_meter import DeviceMeter, autocast_outside_budget
from tightfit.offload.runtime.host_cache import HostCache
from tightfit.offload.runtime.movers import strict_from_env, strict_seed
from tightfit.offload.runtime.workers import StepThread, Timers, Worker, thread_budget
from tightfit.offload.step.budget_checks import check_budgets, host_tier_bytes, largest_job
from tightfit.offload.step.grad_norms import NormPolicy, norms_on_demand
from tightfit.offload.step.gradients import GradientShipper
from tightfit.offload.step.hooks import queue_end_of_backward, register_hooks, remove_hooks
from tightfit.offload.step.lifecycle import Event, ParamsState, Phase
from tightfit.offload.step.master_io import (
    initialise,
    read_master,
    replace_meta_params,
    write_master,
    write_params,
)
from tightfit.offload.step.optimizer import Multipliers, StepRunner, Work
from tightfit.offload.step import reports
from tightfit.offload.step.passes import UnitMajorPass
from tightfit.offload.step.residency import Residency
from tightfit.offload.step.runtime_setup import build_runtime
from tightfit.offload.step.scheduler import MoveKind, Scheduler, StepPhase
from tightfit.offload.step.step_queue import StepQueue
from tightfit.offload.step.unit import PARAMS, OffloadUnit
from tightfit.offload.step.units import UnitPolicy, find_units
from tightfit.offload.step.write_backs import WriteBacks
from tightfit.offload.tiers.stores import TierStore

from tightfit.utils.sizes import format_size

_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # wrapped model -> its engine
_PARAM_ENGINE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # wrapped parameter -> its engine

@dataclass(frozen=True)
class DeclaredStep:
    """An optimizer step the optimizer has declared to follow the coming backward."""

    units: frozenset[str]
    """Units with parameters in the optimizer: the only ones preloaded, held for and stepped."""
    early: Callable | None = None
    """Step a unit as soon as its gradients land (`AdamW.step_during_backward`): callable(unit)."""


WORKER_DELAY_S = 0.002
"""Strict mode: the most a gradient or step job waits before it starts (runtime/workers.py)."""


def engine_of(model: nn.Module) -> "OffloadEngine":
    """The engine of a model returned by `tightfit.wrap`."""
    engine = _ENGINES.get(model)
    if engine is None:
        raise UsageError("this model is not wrapped; call tightfit.wrap(model, placement) first")
    return engine


def find_engine(model: nn.Module) -> "OffloadEngine | None":
    """The engine of a wrapped model, None for any other model."""
    return _ENGINES.get(model)


def engine_of_param(p: torch.Tensor) -> "OffloadEngine | None":
    return _PARAM_ENGINE.get(p)


def _close_quietly(engine: "OffloadEngine") -> None:
    """Finalizer of a model dropped without `close()`: nobody is left to report an error to."""
    with contextlib.suppress(Exception):
        engine.close()


class OffloadEngine:
    """Streams one model's unit states across device, host and NVMe. Built by `tightfit.wrap`."""

    def __init__(self, model: nn.Module, placement: Placement, compute_dtype: torch.dtype,
                 device: torch.device, units: UnitPolicy = None, disk=None) -> None:
        if _ENGINES.get(model) is not None:
            raise UsageError("wrap: this model is already wrapped")
        if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise UsageError(f"wrap(compute_dtype=...): use torch.float32, bfloat16 or float16, not {compute_dtype}")
        self._model = weakref.ref(model)  # weak: the model's hooks hold the engine, not the other way round
        self._closed = False
        self.compute_dtype = compute_dtype
        self.device = device
        self.meta_init = replace_meta_params(model)
        specs = find_units(model, units, min_bytes=placement.min_unit_bytes,
                           # blocks one rank owns stay apart (ZeRO-3): each has its owner
                           group_key=lambda path, p=placement: (p.of(path), p.checkpoints(path), p.steps_here(path),
                                                                p.is_exchanged(path) and path))
        names = {s.name for s in specs} | {path for s in specs for path, _ in s.members}
        for name in [*placement.units, *placement.checkpoint_units]:
            if name not in names:
                raise UsageError(f"placement names unit {name!r}, which this model does not have; units are: "
                                 f"{', '.join(sorted(names))}")
        # Grouped blocks ([Note: grouped blocks]): the placement's per-block entries become the group's.
        placement = placement.for_groups({s.name: [path for path, _ in s.members] for s in specs if s.members})
        self.placement = placement
        if ROOT_UNIT in placement.checkpoint_units:
            raise UsageError(f"placement.checkpoint_units: the {ROOT_UNIT!r} unit cannot be checkpointed")
        if placement.uses(Tier.NVME) and not placement.nvme_dir:
            raise UsageError("placement puts states on nvme but gives no nvme_dir; pass --nvme PATH")

        # The pool, the mover and the tier stores (runtime_setup.py); the pool's capacity is set below, once the
        # host tier is known.
        cuda = device.type == "cuda"
        strict = strict_from_env()
        rt = build_runtime(placement, device, disk, strict)
        self.separate, self._pinned, self.pool, self.mover = rt.separate, rt.pinned, rt.pool, rt.mover
        self.stores: dict[Tier, TierStore] = rt.stores
        self.units: dict[str, OffloadUnit] = {
            s.name: OffloadUnit(s, placement.of(s.name), self.stores, compute_dtype, device, self.separate,
                                placement.cast_on_device, placement.steps_here(s.name),
                                placement.keeps_grads(s.name), placement.holds_params(s.name),
                                placement.is_exchanged(s.name))
            for s in specs}
        try:
            check_budgets(self.units, placement, self.separate)
        except BaseException:
            self._close_stores()
            raise

        # [Note: jobs and grants] in host_memory.py: every transfer and optimizer buffer is granted by this pool.
        self.pool.capacity = (None if placement.host_budget is None
                              else placement.host_budget - host_tier_bytes(self.units, self.separate))
        self.pool.largest_job = largest_job(self.units, self.separate)[0]
        self.cache = HostCache()  # what is held ahead of (or past) a transfer, for every unit
        self.timers = Timers()
        delay = WORKER_DELAY_S if strict else 0.0
        # Gradient worker: accumulates gradients that left the device into their host/disk tier, one unit after
        # another, overlapping the backward of the units after. One thread keeps micro-batches of a unit in order.
        # Step thread: runs every unit's optimizer step, during backward as its gradients land or after it, in the
        # next forward's order; each is awaited by the unit's next use ([Note: steps under the next forward] in
        # step_queue.py). Both shut down by `close`.
        # Their intra-op threads: [Note: thread budget] in workers.py.
        self._threads = budget = thread_budget(torch.get_num_threads(), cuda)
        self.grad_worker = Worker("tightfit-grads", delay, seed=strict_seed() + 1, threads=budget["grads"])
        self.step_worker = StepThread("tightfit-step", delay, seed=strict_seed() + 2, threads=budget["step"])
        self.writes = WriteBacks()  # the optimizer's write-backs in flight (write_backs.py)
        self.scheduler = Scheduler(placement.prefetch_depth)
        self.meter = DeviceMeter(self.stores[Tier.DEVICE], placement.device_budget, self.mover)
        self.shipper = GradientShipper(self.pool, self.mover, self.cache, self.grad_worker, self.timers,
                                       land_fp32=placement.land_grads_fp32)
        self.stepper = StepRunner(self.pool, self.cache, self.mover, self.writes, self.scheduler, self.timers,
                                  device, self.separate)
        self.steps = StepQueue(self.step_worker, self.writes, self.timers, self._before_step, self._steps_here)
        self.residency = Residency(self.units, self.meter, self.mover, self.pool, self.cache, self.timers,
                                   placement.device_budget, self._keeps_master, lambda: self.phase)
        self.phase = StepPhase.IDLE
        # Declared by the optimizer for one backward (`declare_step`): a step of these units follows it, run during
        # backward as each unit's gradients land (`early`), or after it (it clips or unscales); either way each unit's
        # master and moments start loading as its backward starts.
        self.declared: DeclaredStep | None = None
        self.norms = NormPolicy()  # when the gradient worker takes norms: [Note: norms when asked]
        # ZeRO-2 over the engine (parallel/sharded_optimizer.py): the ranks' norms, each rank's own units' only, made
        # every rank's whole list; None otherwise.
        self.norms_over_ranks: Callable[[list[torch.Tensor], list[OffloadUnit]], list[torch.Tensor]] | None = None
        self._early_submitted = 0  # units stepped during the running step's backward (`submit_early_step`)
        self._grads_charged: dict[str, int] = {}  # device bytes of this backward's param.grads, per unit
        self._warned_autocast = False
        self._t_step = self._t_bwd = None
        self.backwards = 0  # backward passes finished (the optimizer warns when one left it nothing to step)
        # A unit-major pass in progress (step/unit_major.py, passes.py): its micro-batches' events count to M.
        self.pass_: UnitMajorPass | None = None
        self.boundaries = None  # a unit-major executor's BoundaryStore (step/boundaries.py), while it has one
        self.on_close: list = []  # callables run first by `close` (module_state.attach's removal)
        # ZeRO-3 over the engine: where the exchanged units' params come from for each use
        # (tightfit/parallel/params_exchange.py, `attach_exchange`); None otherwise.
        self.exchange = None

        try:
            for unit in self.units.values():
                initialise(unit, self.stores, self.meta_init, self.compute_dtype)
        except BaseException:  # e.g. a full swap disk: a refused wrap leaves no threads, swap files or lock behind
            self._close_stores()
            raise
        self.meter.charge(0)  # the peak starts at the device tier's states
        budget = placement.device_budget
        if budget is not None and self.stores[Tier.DEVICE].bytes > budget:
            raise UsageError(f"device budget {format_size(budget)} is smaller than the states placed on the device "
                             f"tier ({format_size(self.stores[Tier.DEVICE].bytes)}); raise --gpu-mem or place "
                             "more states on host/nvme")
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    module._buffers[key] = buf.to(device)
        # Trainable parameter -> (unit, index in unit.trainable), and the model's parameter order (for norms).
        self._slot_of = {id(s.param): (u, i) for u in self.units.values() for i, s in enumerate(u.trainable)}
        self._param_order = [self._slot_of[id(p)] for p in model.parameters() if id(p) in self._slot_of]
        self._handles = register_hooks(self)
        _ENGINES[model] = self
        # A model dropped without `close()` closes its engine when collected (or at interpreter exit): the
        # threads stop and the swap files go.
        self._finalizer = weakref.finalize(model, _close_quietly, self)
        for unit in self.units.values():
            for slot in unit.spec.slots:
                _PARAM_ENGINE[slot.param] = self

    def _close_stores(self) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()

    # ---- values ------------------------------------------------------------------------------------------------

    def write_master(self, unit: OffloadUnit, master: torch.Tensor) -> None:
        """Store fp32 master values (a host tensor of the unit's flat size) and the compute params cast from them."""
        self.wait_step(unit)
        write_master(unit, master, self.compute_dtype)
        self._stale(unit)

    def write_params(self, unit: OffloadUnit, params: torch.Tensor) -> None:
        """Store the compute-dtype values of a unit another rank steps (`master_io.write_params`)."""
        write_params(unit, params)
        self._stale(unit)

    def read_params(self, unit: OffloadUnit, out: torch.Tensor | None = None, after_step: bool = True
                    ) -> torch.Tensor:
        """The unit's compute-dtype values after its last step, in `out` (a host tensor of the unit's flat size) or a
        new host tensor. `after_step` False: the caller has waited for the step (another thread than the forward's,
        which alone clears `stepping`)."""
        if after_step:
            self.wait_step(unit)
        self.residency.wait_refresh(unit)
        if out is None:
            out = torch.empty(unit.spec.numel, dtype=self.compute_dtype)
        unit.read_params(out)
        return out

    def _stale(self, unit: OffloadUnit) -> None:
        """The unit's stored values changed: its device copy and every cached copy are stale."""
        if unit.on_device and not unit.resident:
            self.release(unit)  # the device copy is stale
        unit.version += 1  # and so is every cached copy
        self.cache.drop(unit.name)

    def read_master(self, unit: OffloadUnit) -> torch.Tensor:
        """The unit's fp32 master values as a new host tensor."""
        self.wait_step(unit)
        return read_master(unit, self.compute_dtype)

    # ---- device memory ---------------------------------------------------------------------------------------

    @property
    def device_in_use(self) -> int:
        """Bytes on the device: device-tier states (resident) + materialised units and pending gradients."""
        return self.meter.in_use

    @property
    def device_bytes(self) -> int:
        """The transient part: materialised units' flat buffers and gradients not yet copied off."""
        return self.meter.transient

    @property
    def device_peak(self) -> int:
        return self.meter.peak

    @property
    def host_waits(self) -> Counter:
        return self.meter.host_waits

    @property
    def computing(self) -> bool:
        """Is a forward or backward of the model running?"""
        return self.phase is not StepPhase.IDLE

    def declare_step(self, units, early=None) -> None:
        """The optimizer's word that a step of `units` (names) follows the coming backward; `early(unit)`: step each
        unit as soon as its gradients land (`AdamW.step_during_backward`). Covers one backward."""
        self.declared = DeclaredStep(frozenset(units), early)
        self.norms.on_declare()

    @property
    def step_follows(self) -> bool:
        """Has the optimizer declared that a step follows the running backward?"""
        return self.declared is not None

    @property
    def early_step(self):
        """The declared step's `early` callable, or None."""
        return self.declared.early if self.declared is not None else None

    def _stepped(self, unit: OffloadUnit) -> bool:
        """Will the declared step step `unit`?"""
        return self.declared is not None and unit.name in self.declared.units

    def materialise(self, unit: OffloadUnit) -> None:
        """The unit computes now (a hook's event): its params on the device, after its last step."""
        if unit.exchanged and self.exchange is not None:
            self.exchange.visit(unit)  # a use of its params, sent by its owner ([Note: parameters sent for each use])
        if unit.stepping is not None:
            self.wait_step(unit)
            self.mover.order_compute()  # and after the step's writes into device memory, as a GPU's stream orders
        self.residency.materialise(unit)

    def attach_exchange(self, exchange) -> None:
        """From now on the exchanged units' params come from `exchange` for each use (ZeRO-3,
        tightfit/parallel/params_exchange.py), closed with the engine."""
        self.exchange = self.residency.exchange = exchange

    def release(self, unit: OffloadUnit) -> None:
        self.residency.release(unit)

    def _keeps_master(self, unit: OffloadUnit) -> bool:
        """Does a params fetch of `unit` starting now keep its staging buffer as the master of the unit's coming step?
        ([Note: master from the fetch]) For fp32 params that are their master, when this is the unit's last fetch
        before its step: in backward when the declared step steps it; in forward, on a device apart from host memory,
        for the root and the units that stay materialised for backward (no step is declared yet: kept on the chance,
        within the speculative bound, and a valid copy for the next forward's fetch if no step comes)."""
        if (not unit.trainable or unit.master_entry != PARAMS or PARAMS not in unit.jobs.get("step", {})
                or self.cache.holds(unit.name, PARAMS, unit.version)):
            return False
        if self.phase == StepPhase.BACKWARD:
            return self._stepped(unit)
        # On a CPU device sharing host memory these units give their master from their materialised params instead
        # (a memcpy, or the root's step in place): nothing to keep.
        return (self.phase == StepPhase.FORWARD and self.separate
                and (unit.spec.is_root or self.scheduler.keep_after_forward(unit.name)))

    def _issue(self, moves) -> None:
        self.scheduler.issue(moves, {MoveKind.FETCH: self.residency.fetch_ahead, MoveKind.PRELOAD: self._preload})

    def _preload(self, name: str) -> bool:
        """The scheduler's PRELOAD move, for units the declared step will step."""
        unit = self.units[name]
        in_flat = (self.early_step is not None and self.stepper.steps_in_flat(unit)
                   and unit.params_state == ParamsState.READY)
        return not self._stepped(unit) or self.stepper.preload(unit, in_flat)

    # ---- events from the hooks -------------------------------------------------------------------------------

    def _check_autocast(self) -> None:
        """Refuse under a device budget, else warn once: autocast's casts are device memory the meter cannot see."""
        msg = autocast_outside_budget(self.device, self.compute_dtype)
        if msg is not None and self.placement.device_budget is not None:
            raise UsageError(msg)
        if msg is not None and not self._warned_autocast:
            self._warned_autocast = True
            warnings.warn(msg, stacklevel=3)

    def on_root_forward_start(self) -> None:
        self._check_autocast()
        if torch.is_grad_enabled():
            self.timers.add("micro_batches", 1)
        if self.pass_ is not None:
            self.pass_.roots_open += 1
            if self.pass_.roots_open > 1:
                return  # a pass's forward phase spans its micro-batches: it started with the first
        self.phase = StepPhase.FORWARD
        self._t_step = time.perf_counter()
        self.scheduler.begin(StepPhase.FORWARD)
        if self.exchange is not None:
            self.exchange.begin(StepPhase.FORWARD)
        root = self.units[ROOT_UNIT]
        root.life.on(Event.FORWARD_START)
        self.mover.order_compute()  # the last step's writes into device memory first (a GPU's stream order)
        self.materialise(root)
        self._issue(self.scheduler.moves(StepPhase.FORWARD, None, step_follows=False))

    def on_root_forward_end(self) -> None:
        if self.pass_ is not None:
            self.pass_.roots_open -= 1
            if self.pass_.roots_open > 0:
                return  # ... and ends with the last
        self.scheduler.end(StepPhase.FORWARD)
        if self.phase is not StepPhase.BACKWARD:  # a pass's tails start its backward before the last forward ends
            self.phase = StepPhase.IDLE  # ([Note: the tail per micro-batch] in unit_major.py)
        root = self.units[ROOT_UNIT]
        if torch.is_grad_enabled():
            root.life.on(Event.FORWARD_END)
        else:
            root.life.on(Event.FORWARD_END_NO_GRAD)
            self.release(root)
        self.timers.since("forward_s", self._t_step)

    def on_unit_forward_start(self, unit: OffloadUnit) -> None:
        unit.life.on(Event.FORWARD_START)
        moves = (self.scheduler.moves(StepPhase.FORWARD, unit.name, step_follows=False)
                 if self.phase == StepPhase.FORWARD else [])
        self.materialise(unit)
        self._issue(moves)

    def on_unit_forward_end(self, unit: OffloadUnit) -> None:
        if not torch.is_grad_enabled():
            unit.life.on(Event.FORWARD_END_NO_GRAD)
            self.release(unit)
            return
        unit.life.on(Event.FORWARD_END)
        if self.pass_ is not None and not self.pass_.forward_ended(unit.name):
            return  # the next micro-batch computes this unit next: it stays, computing
        if self.phase == StepPhase.FORWARD and self.scheduler.keep_after_forward(unit.name):
            # Among the first units of the coming backward: it stays materialised instead of being read again right
            # away. It is no longer computing, so a fetch that needs the room can still evict it (`materialise`).
            self.residency.idle(unit)
            return
        self.release(unit)

    def _enter_backward(self) -> None:
        if self.phase == StepPhase.BACKWARD:
            return
        self.phase = StepPhase.BACKWARD
        root = self.units[ROOT_UNIT]
        self._charge_grads(root)  # the root's grads (the head's) come first and stay longest
        self._t_bwd = time.perf_counter()
        self.scheduler.begin(StepPhase.BACKWARD)
        if self.exchange is not None:
            self.exchange.begin(StepPhase.BACKWARD)
        if self.step_follows:  # the root's master and moments load under the whole backward
            self._issue(self.scheduler.preloads_ahead([ROOT_UNIT], 0))
        if self.pass_ is None:  # a pass's backward is many graph tasks: the executor ends it (`end_pass`)
            queue_end_of_backward(self._end_of_backward)

    def on_unit_backward_start(self, unit: OffloadUnit) -> None:
        self._enter_backward()
        unit.life.on(Event.BACKWARD_START)
        moves = self.scheduler.moves(StepPhase.BACKWARD, unit.name, self._preloads_now(unit))
        self._charge_grads(unit)
        self.materialise(unit)
        self._issue(moves)

    def _preloads_now(self, unit: OffloadUnit) -> bool:
        """Does the unit's optimizer state start loading as its backward starts? When a step follows this backward:
        stepped during it, each unit's step comes right after its backward; stepped after it (a clip), under the next
        forward in its order ([Note: steps under the next forward] in step_queue.py), so only the first units of
        that forward load now (what backward loads waits in the speculative share until its step, and the units
        backward reaches last are the ones the forward needs first); the step thread loads the others ahead of
        their steps."""
        return self.step_follows and (self.early_step is not None or unit.name in self.scheduler.first(
            StepPhase.FORWARD))

    def _charge_grads(self, unit: OffloadUnit) -> None:
        """Count the `param.grad`s autograd is about to produce for the unit (freed when they are shipped), and in a
        pass the fp32 sums they are folded into ([Note: gradient sums on the device] in unit.py)."""
        if unit.name not in self._grads_charged:
            nbytes = unit.grad_bytes + (unit.sum_bytes if self._folds(unit) else 0)
            # the budget's guarantee (check_budgets) covers computing units
            self.residency.make_room(unit, nbytes)
            self._grads_charged[unit.name] = nbytes
            self.meter.charge(nbytes)

    def _folds(self, unit: OffloadUnit) -> bool:
        """Are the unit's gradients folded into fp32 sums on the device as they accumulate? In a pass, where autograd
        would add micro-batches in the compute dtype: [Note: gradient sums on the device] in unit.py."""
        return self.pass_ is not None and unit.compute_dtype != torch.float32

    def _uncharge_grads(self, unit: OffloadUnit, packing=None) -> None:
        """Stop counting the unit's `param.grad`s: now, or once `packing` (their copy off the device) is done."""
        self.meter.uncharge(self._grads_charged.pop(unit.name, 0), after=packing)

    def on_grad(self, unit: OffloadUnit, index: int) -> None:
        self._enter_backward()
        if self._folds(unit):
            unit.fold_grad(index)
        unit.got.add(index)
        self._maybe_finish(unit)

    def on_unit_inputs_grad(self, unit: OffloadUnit) -> None:
        unit.open_calls -= 1
        self._maybe_finish(unit)

    def _maybe_finish(self, unit: OffloadUnit) -> None:
        if self.pass_ is not None:
            return  # the executor says when ([Note: the end of a unit's backward in a pass] in passes.py)
        if (unit.life.phase in (Phase.AWAITING_BACKWARD, Phase.BACKWARD) and unit.open_calls <= 0
                and len(unit.got) == len(unit.trainable)):
            self._finish_backward(unit)

    def _finish_backward(self, unit: OffloadUnit) -> None:
        norms = self.norms.eager(self.declared is not None, self.early_step is not None)
        threads = self._threads["grads" if self.early_step is not None else "alone"]  # [Note: thread budget]
        # A pass's sums are final when they leave: their norms are taken where they are (no host pass over them).
        self._uncharge_grads(unit, packing=self.shipper.ship(unit, hold=self._stepped(unit), norms=norms,
                                                             threads=threads, final=self.pass_ is not None))
        if (self.early_step is not None and self.stepper.steps_in_flat(unit) and any(unit.has_grad)
                and unit.params_state == ParamsState.READY):
            unit.life.on(Event.KEEP_FOR_STEP)  # stays materialised: stepped in place, then used by the next forward
        else:
            self.release(unit)
        unit.life.on(Event.BACKWARD_END)
        unit.got.clear()
        unit.open_calls = 0
        if self.early_step is not None and any(unit.has_grad):
            self.early_step(unit)

    def submit_early_step(self, unit: OffloadUnit, run) -> None:
        """Run `run()` (one unit's optimizer step) on the step thread once the unit's gradients have landed, during
        the backward of the units before it (`AdamW.step_during_backward`)."""
        self._early_submitted += 1
        self.steps.submit(unit, run)

    def _before_step(self, unit: OffloadUnit) -> None:
        """Step thread, before a unit's step: its intra-op threads ([Note: thread budget] in workers.py), and after
        backward the scheduler's PRELOAD moves for the next `depth` queued steps, so their loads overlap this one
        ([Note: moves]; speculative, stopping at the first the pool refuses)."""
        self.step_worker.use_threads(self._threads["alone" if self._grads_done() else "step"])
        if self.phase is StepPhase.BACKWARD:
            return  # a declared step's preloads follow the backward ([Note: moves])
        names = self.step_worker.upcoming(self.placement.prefetch_depth)
        self.scheduler.issue(self.scheduler.preloads_ahead(names, 0),
                             {MoveKind.PRELOAD: lambda name: self.stepper.preload(self.units[name])})

    def _steps_here(self, unit: OffloadUnit) -> bool:
        """May the thread waiting for the unit's step run it? On a CPU device whose memory is the host's, a step
        that needs no buffer of the pool ([Note: a step run by the thread that waits for it] in step_queue.py)."""
        return self.device.type == "cpu" and not self.separate and not unit.jobs.get("step")

    def wait_step(self, unit: OffloadUnit) -> None:
        """The unit's last optimizer step is done ([Note: steps under the next forward] in step_queue.py)."""
        self.steps.wait(unit)

    def _grads_done(self) -> bool:
        """Is backward over and every gradient added? Then the gradient worker's cores are idle ([Note: thread
        budget] in workers.py). Read from the step thread: a unit whose job is just ending counts as busy."""
        return self.phase is not StepPhase.BACKWARD and self.grad_worker.idle()

    @property
    def stepped_during_backward(self) -> bool:
        """Were units stepped during this step's backward (`submit_early_step`), before `opt.step()`?"""
        return self._early_submitted > 0

    def wait_steps(self) -> None:
        """Wait for every unit's optimizer step still running or queued (not for their write-backs): the states are
        then what the steps made them. Raises the first step's error, after waiting for all."""
        self.steps.wait_all(self.units.values())

    def wait_writes(self) -> None:
        """Block until every optimizer write-back of the steps taken so far (queued ones run first) has reached its
        tier; raise the first failure."""
        self.wait_steps()
        self.writes.wait()
        for unit in self.units.values():
            if unit.refresh is not None:
                self.mover.sync(unit.refresh)
                unit.refresh = None

    # ---- a unit-major pass (step/unit_major.py runs it; passes.py) --------------------------------------------

    def begin_pass(self, micro_batches: int) -> None:
        """The executor's word that the coming forwards and backward run `micro_batches` micro-batches unit by unit.
        A pass is a whole step's accumulation: it starts with no gradient accumulated."""
        if self.pass_ is not None or self.phase is not StepPhase.IDLE:
            raise UsageError("a unit-major pass starts while the model is in a forward or backward")
        if any(any(u.has_grad) for u in self.units.values() if u.stepping is None):  # a queued step owns its own
            raise UsageError("a unit-major pass accumulates a whole step: call opt.step() or opt.zero_grad() first")
        self.pass_ = UnitMajorPass(micro_batches)

    def micro_batch_done(self, name: str) -> None:
        """The executor's backward of one micro-batch's segment of unit `name` has returned ([Note: the end of a
        unit's backward in a pass]): at the M-th its gradients are summed and leave."""
        unit = self.units[name]
        if self.pass_.backward_done(name) and unit.life.phase in (Phase.AWAITING_BACKWARD, Phase.BACKWARD):
            self._finish_backward(unit)

    def end_pass(self) -> None:
        """The pass's last segment's backward has returned (or the pass failed): what is left finishes (the root)."""
        try:
            if self.phase is StepPhase.BACKWARD:
                self._end_of_backward()
        finally:
            self.pass_ = None

    def _end_of_backward(self) -> None:
        self.steps.prioritise(self.next_forward_order())  # [Note: steps under the next forward]
        for unit in self.units.values():
            if unit.life.phase in (Phase.AWAITING_BACKWARD, Phase.BACKWARD) or unit.got:
                self._finish_backward(unit)
        for unit in self.units.values():
            self._uncharge_grads(unit)
        self.residency.release_all(keep_stepping=True)  # prefetches the step did not use
        self.declared = None  # a declared step covers one backward
        self.scheduler.end(StepPhase.BACKWARD)
        self.phase = StepPhase.IDLE
        self.backwards += 1
        self.timers.since("backward_s", self._t_bwd)

    # ---- gradients and the step ------------------------------------------------------------------------------

    def wait_grads(self) -> None:
        """Block until every gradient shipped so far has reached its tier."""
        for unit in self.units.values():
            if unit.grad_pending is not None:
                unit.grad_pending.result()
                unit.grad_pending = None
        self.meter.settle()  # a unit's gradients have landed, so their pack is done

    def zero_grad(self) -> None:
        """Drop the accumulated gradients, except those a unit's queued step owns (it consumes them)."""
        self.norms.end_step(self.backwards)
        self._early_submitted = 0
        for unit in self.units.values():
            if unit.stepping is not None:
                continue  # its step takes what was held for it, and clears its gradients
            if unit.grad_pending is not None:
                unit.grad_pending.result()
                unit.grad_pending = None
            # What was held for a step (gradients, master and moments loaded ahead) goes; params stay for the next
            # forward (a step's updated params, or a fetch's copy of values no step changed).
            self.cache.drop(unit.name, keep=(PARAMS,))
            unit.clear_grads()
            unit.life.on(Event.ZERO_GRAD)
        self.meter.settle()  # the packs done so far no longer hold device memory

    def step_units(self, work: list[Work], grad_scales: Multipliers) -> None:
        """The optimizer step of `work` (optim.AdamW.step) after backward: queued, each unit's on the step thread,
        in the next forward's order, with the units stepped during backward and not started yet; each unit's next
        use waits for its own ([Note: steps under the next forward]). Then the gradients are the steps'."""
        self.writes.check()  # a write-back of the last step failed: its entry is stale, stop here
        work = [w for w in work if w[1]]
        if work:
            self.residency.release_all()  # a materialised copy would go stale
        order = self.next_forward_order()
        rank = {name: i for i, name in enumerate(order)}
        for unit, groups in sorted(work, key=lambda w: rank.get(w[0].name, len(rank))):
            # `groups` holds the hyperparameters as they are now (optim.AdamW._work): the loop sets the next step's
            # learning rate before this one has run.
            self.steps.submit(unit, lambda unit=unit, groups=groups: self.stepper.step_one(unit, groups, grad_scales))
        self.steps.prioritise(order)
        self.zero_grad()

    def next_forward_order(self) -> list[str]:
        """The units in the order the next forward needs them: the root first, then the recorded forward order,
        then any other."""
        names = [ROOT_UNIT, *(n for n in self.scheduler.order[StepPhase.FORWARD] if n != ROOT_UNIT)]
        seen = set()
        order = [n for n in names if n in self.units and not (n in seen or seen.add(n))]
        return order + [n for n in self.units if n not in seen]

    def locate(self, p: torch.Tensor) -> "tuple[OffloadUnit, int] | None":
        """(unit, index into unit.trainable) of a trainable parameter of this model; None if frozen."""
        return self._slot_of.get(id(p))

    def grad_norms_in_model_order(self) -> list[torch.Tensor]:
        """Every accumulated gradient's 2-norm, in model order; those the worker did not take are taken now
        ([Note: norms when asked] in grad_norms.py)."""
        self.wait_grads()
        self.wait_steps()  # a unit's queued step of the last step owns what it clears (none after a forward)
        self.norms.on_ask()
        for unit in self.units.values():
            self.timers.add("host_grad_bytes", norms_on_demand(unit, self.cache, self.pool))
        held = [(u, i) for u, i in self._param_order if u.has_grad[i]]
        norms = [u.grad_norms[i] for u, i in held]
        if self.norms_over_ranks is not None and norms:
            norms = self.norms_over_ranks(norms, [u for u, _ in held])
        return norms

    def step_order(self) -> list[OffloadUnit]:
        """Units in the order the optimizer steps them: backward order (their gradients are ready first)."""
        return [self.units[n] for n in self.scheduler.step_order(list(self.units))]

    # ---- introspection ---------------------------------------------------------------------------------------

    def timings(self) -> dict[str, float]:
        """Amounts since the last `reset_timings` (reports.timings)."""
        return reports.timings(self)

    def reset_timings(self) -> None:
        self.timers.clear()

    def counters(self) -> dict[str, float]:
        """What the engine moved and spent since it was built (reports.counters, [Note: engine counters])."""
        return reports.counters(self)

    def memory_report(self) -> dict:
        """Bytes per tier and per unit state (reports.memory_report)."""
        return reports.memory_report(self)

    unit_report = staticmethod(reports.unit_report)

    @property
    def model(self) -> nn.Module | None:
        """The wrapped model (None once it has been collected)."""
        return self._model()

    def close(self) -> None:
        """Remove the hooks and free the engine's buffers (the model is unusable afterwards). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:  # a failed gradient, step or write-back is raised, after everything below is freed all the same
            self.wait_grads()
            self.wait_steps()
            self.wait_writes()
        finally:
            try:
                for fn in self.on_close:
                    fn()
            finally:
                remove_hooks(self, self._handles)
                self.cache.clear()
                self.grad_worker.shutdown()
                self.step_worker.shutdown()
                self.mover.close()
                self._close_stores()
                self.pool.clear()
                model = self.model
                if model is not None:
                    _ENGINES.pop(model, None)
