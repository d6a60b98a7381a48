"""The offload engine: owns the units, the tier stores and the mover, and reacts to the hooks' events.

Why one object: everything that must agree about a step (which units are on the device, how many device bytes are
in use, which gradients are still travelling) lives here, so the invariants are checked in one place. It is
found through `engine_of(model)` / `engine_of_param(p)`, two weak registries keyed by object identity: nothing is
attached to the model's parameters.

Life of a unit's parameters in one step (see docs/ENGINE.md for the full picture):
  forward start    -> materialise (wait for the prefetch, or fetch now); prefetch the next `depth` units
  forward end      -> release (storage freed; autograd's saved views stay valid, see flat_unit's note), unless
                      the unit is among the first `depth` of the coming backward (it stays, idle)
  backward start   -> materialise again; prefetch the next units in backward order
  grads complete   -> ship the gradients to the grads tier (accumulating), release
  end of backward  -> ship/release whatever the per-unit events did not (unused parameters, frozen units)
The root unit is materialised from the model's forward start until its gradients are complete; when it is stepped
during backward on a CPU device it stays materialised into the next step ([Note: master from the fetch]).

The device budget is metered by `DeviceMeter` (device_meter.py, [Note: device budget]).
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import aligned_empty
from tightfit.offload.step.budget_checks import check_budgets, host_tier_bytes
from tightfit.offload.runtime.device_meter import DeviceMeter, autocast_outside_budget
from tightfit.offload.step.unit import MASTER, PARAMS, GradsState, OffloadUnit, ParamsState
from tightfit.offload.step.gradients import ship_grads
from tightfit.offload.step.hooks import queue_end_of_backward, register_hooks, remove_hooks
from tightfit.offload.runtime.host_cache import HostCache
from tightfit.offload.step.optimizer import preload
from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.offload.step.scheduler import Phase, Schedule
from tightfit.offload.runtime.movers import CpuMover, CudaMover, Transfer, strict_from_env
from tightfit.offload.runtime.host_memory import BufferPool, HostAllocator, RegisteredAllocator
from tightfit.offload.tiers.stores import DiskStore, MemoryStore, TierStore
from tightfit.offload.step.units import UnitPolicy, find_units
from tightfit.offload.step.write_backs import WriteBacks
from tightfit.utils.sizes import format_size

_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # wrapped model -> its engine
_PARAM_ENGINE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # wrapped parameter -> its engine


def engine_of(model: nn.Module) -> "OffloadEngine":
    """The engine of a model returned by `tightfit.wrap`."""
    engine = _ENGINES.get(model)
    if engine is None:
        raise UsageError("this model is not wrapped; call tightfit.wrap(model, placement) first")
    return engine


def engine_of_param(p: torch.Tensor) -> "OffloadEngine | None":
    return _PARAM_ENGINE.get(p)


def _close_quietly(engine: "OffloadEngine") -> None:
    """Finalizer of a model dropped without `close()`: nobody is left to report an error to."""
    with contextlib.suppress(Exception):
        engine.close()


def _replace_meta_params(model: nn.Module) -> bool:
    """Swap parameters on the meta device for storage-less CPU parameters of the same shape (ties kept).

    Why: a model too large for host memory is built under `torch.device("meta")`, wrapped, and then given its
    values unit by unit with `state_io.import_state`; `param.data` cannot be re-pointed from meta to real memory,
    so those parameters are replaced (before units are found, so the engine only ever sees the new ones).
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    empty = torch.empty(0, dtype=p.dtype).set_(torch.UntypedStorage(0), 0, p.shape)
                    new[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                module._parameters[key] = new[id(p)]
    return bool(new)


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
        self.meta_init = _replace_meta_params(model)
        specs = find_units(model, units, min_bytes=placement.min_unit_bytes,
                           group_key=lambda path, p=placement: (p.of(path), p.checkpoints(path)))
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

        # The mover ([Note: the mover contract], movers.py) and the host memory it stages through. On CUDA, staging
        # buffers and the host tier's params are page-locked by `RegisteredAllocator` (exactly metered, freed when
        # dropped); nothing else is. The strict CPU mover (copies complete late, the contract checked) is what the
        # test suite runs.
        cuda = device.type == "cuda"
        self._pinned = RegisteredAllocator() if cuda else None
        staging = RegisteredAllocator() if cuda else HostAllocator()
        self.pool = BufferPool(None, allocator=staging)  # capacity set below, once the host tier is known
        self.mover = CudaMover(self.pool, device) if cuda else CpuMover(self.pool, strict=strict_from_env())
        # The stores, one per tier. Device: the compute device. Host: CPU memory. Disk: created only when some state
        # is placed there. All live until `close`. Copies across devices run on the mover's copy thread.
        copier = self.mover.copy_async
        self.stores: dict[Tier, TierStore] = {
            Tier.DEVICE: MemoryStore(Tier.DEVICE, device, copier=copier),
            Tier.HOST: MemoryStore(Tier.HOST, torch.device("cpu"), pinned=self._pinned, copier=copier),
        }
        if placement.uses(Tier.NVME):
            # `disk` (nvme.DiskTuning, from wrap): overrides of the disk tuning the store derives by itself.
            self.stores[Tier.NVME] = DiskStore(placement.nvme_dir, placement.nvme_budget,
                                               threads=disk.threads if disk else None,
                                               chunk_bytes=disk.chunk_bytes if disk else None)
        self.units: dict[str, OffloadUnit] = {
            s.name: OffloadUnit(s, placement.of(s.name), self.stores, compute_dtype, device) for s in specs}
        check_budgets(self.units, placement, device)

        # [Note: staging memory] in staging.py: every transfer and optimizer working buffer comes from this pool.
        self.pool.capacity = (None if placement.host_budget is None
                              else placement.host_budget - host_tier_bytes(self.units))
        # What is held ahead of (or past) a transfer, for every unit: one cache, one admission rule that keeps the
        # largest unit's step working set free beside it ([Note: host cache admission], host_cache.py).
        self.cache = HostCache(self.pool, reserve=max(u.step_bytes for u in self.units.values()))
        # Gradient worker: accumulates gradients that left the device into their host/disk tier, one unit after
        # another, overlapping the backward of the units after. One thread keeps micro-batches of a unit in order.
        # Shut down by `close`.
        self.grad_worker = ThreadPoolExecutor(1, thread_name_prefix="tightfit-grads")
        # Step thread: runs the optimizer step of a unit during backward (`AdamW.step_during_backward`), as soon
        # as the unit's last gradients have landed, overlapping the backward of the units before it. Its futures
        # are collected in `_early_steps` and awaited by the next `opt.step()`. Shut down by `close`.
        self.step_worker = ThreadPoolExecutor(1, thread_name_prefix="tightfit-step")
        self.early_step = None  # set by the optimizer for one backward: callable(unit) -> None
        # Set by the optimizer for one backward (`AdamW.preload_during_backward`): a step follows it (after backward:
        # it clips or unscales), so each unit's master and moments start loading as its backward starts.
        self.preload_step = False
        self._early_steps: list[Future] = []
        self.writes = WriteBacks()  # the optimizer's write-backs in flight (write_backs.py)
        self.schedule = Schedule(placement.prefetch_depth)
        self.phase = Phase.IDLE
        self._in_backward = False
        self.meter = DeviceMeter(self.stores[Tier.DEVICE], placement.device_budget, self.mover)
        self._active: set[str] = set()  # units materialised because they compute now (not mere prefetches)
        self._timers: dict[str, float] = {}
        self._warned_autocast = False
        self._t_step = None
        self.backwards = 0  # backward passes finished (the optimizer warns when one left it nothing to step)
        self.on_close: list = []  # callables run first by `close` (module_state.attach's removal)

        try:
            for unit in self.units.values():
                self._initialise(unit)
        except BaseException:  # e.g. a full swap disk: a refused wrap leaves no threads, swap files or lock behind
            for store in self.stores.values():
                with contextlib.suppress(Exception):
                    store.close()
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

    # ---- wrap time -------------------------------------------------------------------------------------------

    def _initialise(self, unit: OffloadUnit) -> None:
        """Allocate the unit's entries in their stores, write the model's current values, bind the params."""
        for tier, entries in unit.entries().items():
            self.stores[tier].allocate(unit.name, entries)
        if not self.meta_init:  # a model built on the meta device gets its values from import_state
            master = aligned_empty(unit.spec.numel, torch.float32)
            master.zero_()  # padding between parameters stays zero forever
            for slot in unit.spec.slots:
                slot.view(master).copy_(slot.param.detach())
            self.write_master(unit, master)
        unit.bind()

    def write_master(self, unit: OffloadUnit, master: torch.Tensor) -> None:
        """Store fp32 master values (a host tensor of the unit's flat size) and the compute params cast from them.
        A separate master keeps only the trainable prefix ([Note: frozen parameters] in flat_unit.py)."""
        if unit.master_entry == MASTER:
            if unit.master_numel:
                unit.store[State.MASTER].save(unit.name, MASTER, master[:unit.master_numel]).result()
            unit.store[State.PARAMS].save(unit.name, PARAMS, master.to(self.compute_dtype)).result()
        else:
            unit.store[State.MASTER].save(unit.name, PARAMS, master).result()
        if unit.on_device and not unit.resident:
            self.release(unit)  # the device copy is stale
        unit.version += 1  # and so is every cached copy
        self.cache.drop(unit.name)

    def keeps_fresh(self, unit: OffloadUnit) -> bool:
        """Should the step of `unit` keep its updated params in memory for the next forward's fetch?

        Yes for the first units of the next forward (they are stepped last, and read again right away), when the
        device is the CPU, the params are the fp32 master, and the pool has room for two working sets."""
        if (self.device.type != "cpu" or unit.master_entry != PARAMS or unit.resident
                or unit.name not in self.schedule.first(Phase.FORWARD)):
            return False
        return self.cache.admit(4 * unit.spec.numel)

    def keeps_master(self, unit: OffloadUnit) -> bool:
        """Should a params fetch of `unit` starting now keep its staging buffer for the unit's optimizer step?

        Yes in backward when the unit will be stepped during it, the params are its fp32 master ([Note: master
        from the fetch] in flat_unit.py) and the step would otherwise read them from disk again; and only while
        the pool has room for two working sets, so kept buffers cannot starve the step thread that frees them."""
        if (self.phase != Phase.BACKWARD or self.early_step is None or not unit.trainable
                or unit.master_entry != PARAMS or self.cache.holds(unit.name, PARAMS, unit.version)
                or unit.store[State.MASTER].tensor(unit.name, PARAMS) is not None):
            return False
        return self.cache.admit(4 * unit.spec.numel)

    def steps_in_flat(self, unit: OffloadUnit) -> bool:
        """Does the root unit's optimizer step run in place on its materialised params (CPU, fp32 master)?"""
        return (unit.spec.is_root and self.early_step is not None and bool(unit.trainable)
                and unit.master_entry == PARAMS and unit.flat.device.type == "cpu"
                and unit.params_state == ParamsState.READY)

    def read_master(self, unit: OffloadUnit) -> torch.Tensor:
        """The unit's fp32 master values as a new host tensor."""
        out = aligned_empty(unit.spec.numel, torch.float32)
        if unit.master_entry == MASTER and unit.master_numel < unit.spec.numel:  # frozen tail: the compute copy
            params = aligned_empty(unit.spec.numel, self.compute_dtype)
            unit.store[State.PARAMS].load(unit.name, PARAMS, params).result()
            out.copy_(params)
            del params
        if unit.master_numel:
            unit.store[State.MASTER].load(unit.name, unit.master_entry, out[:unit.master_numel]).result()
        return out

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

    def _make_room(self, keep: OffloadUnit, nbytes: int) -> bool:
        """Evict idle units, then wait for gradients still being packed, until `nbytes` fit; whether they do."""
        if self.meter.fits(nbytes):
            return True
        self._evict_idle(keep)
        if not self.meter.fits(nbytes) and self.meter.packing:
            self.meter.settle(wait=True, phase=self.phase)
        return self.meter.fits(nbytes)

    def materialise(self, unit: OffloadUnit) -> None:
        self._active.add(unit.name)
        if unit.refresh is not None:  # the last step's new compute params are on their way
            self.mover.wait(unit.refresh)
            unit.refresh = None
        if unit.params_state in (ParamsState.RESIDENT, ParamsState.READY):
            return
        t0 = time.perf_counter()
        if unit.params_state == ParamsState.RELEASED:
            if not self._make_room(unit, unit.compute_bytes):
                raise UsageError(
                    f"device budget {format_size(self.placement.device_budget)} exceeded materialising unit "
                    f"{unit.name!r} ({format_size(unit.compute_bytes)}; "
                    f"{format_size(self.device_in_use)} in use); raise --gpu-mem or lower prefetch_depth")
            self.meter.charge(unit.compute_bytes)
            unit.start_fetch(self.mover, self.cache, keep_master=self.keeps_master(unit))
        unit.finish_fetch(self.mover, self.cache)
        self._time("params_wait_s", t0)

    def _evict_idle(self, keep: OffloadUnit) -> None:
        """Release materialised units that are not computing (prefetches, units kept for backward) except `keep`."""
        for other in self.units.values():
            if (other is not keep and other.on_device and not other.resident and other.name not in self._active
                    and not other.master_in_flat):
                self.release(other)

    def prefetch(self, names: list[str]) -> None:
        for name in names:
            unit = self.units[name]
            if unit.resident or unit.on_device or not self.meter.fits(unit.compute_bytes):
                continue
            self.meter.charge(unit.compute_bytes)
            unit.start_fetch(self.mover, self.cache, keep_master=self.keeps_master(unit))

    def release(self, unit: OffloadUnit) -> None:
        self._active.discard(unit.name)
        if unit.resident or not unit.on_device:
            return
        unit.free(self.mover)
        self.meter.uncharge(unit.compute_bytes)

    def release_all(self, keep_stepping: bool = False) -> None:
        """Release every materialised unit; keep_stepping: except the root while its step runs in place."""
        for unit in self.units.values():
            if not (keep_stepping and unit.master_in_flat):
                self.release(unit)

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
        self.phase = Phase.FORWARD
        self._t_step = time.perf_counter()
        self.schedule.begin(Phase.FORWARD)
        root = self.units[ROOT_UNIT]
        self.materialise(root)
        if torch.is_grad_enabled():
            root.awaiting_backward = True
        self.prefetch(self.schedule.first(Phase.FORWARD))

    def on_root_forward_end(self) -> None:
        self.schedule.end(Phase.FORWARD)
        self.phase = Phase.IDLE
        if not torch.is_grad_enabled():
            self.release(self.units[ROOT_UNIT])
        self._time("forward_s", self._t_step)

    def on_unit_forward_start(self, unit: OffloadUnit) -> None:
        nxt = self.schedule.visit(Phase.FORWARD, unit.name) if self.phase == Phase.FORWARD else []
        self.materialise(unit)
        self.prefetch(nxt)
        if torch.is_grad_enabled():
            unit.awaiting_backward = True

    def on_unit_forward_end(self, unit: OffloadUnit) -> None:
        if (self.phase == Phase.FORWARD and torch.is_grad_enabled()
                and unit.name in self.schedule.first(Phase.BACKWARD)):
            # Among the first units of the coming backward: stay materialised instead of being read again right
            # away (what DeepSpeed calls the reuse distance). It is no longer computing, so a fetch that needs
            # the room can still evict it (`materialise`).
            self._active.discard(unit.name)
            return
        self.release(unit)

    def _enter_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        root = self.units[ROOT_UNIT]
        self._charge_grads(root)  # the root's grads (the head's) come first and stay longest
        if self.early_step is not None or self.preload_step:
            preload(self, root)  # its moments load under the whole backward
        self._t_bwd = time.perf_counter()
        self.phase = Phase.BACKWARD
        self.schedule.begin(Phase.BACKWARD)
        queue_end_of_backward(self._end_of_backward)

    def on_unit_backward_start(self, unit: OffloadUnit) -> None:
        self._enter_backward()
        nxt = self.schedule.visit(Phase.BACKWARD, unit.name)
        self._charge_grads(unit)
        self.materialise(unit)
        self.prefetch(nxt)
        if self.early_step is not None or self.preload_step:
            preload(self, unit)  # its optimizer state loads under its own backward

    def _charge_grads(self, unit: OffloadUnit) -> None:
        """Count the `param.grad`s autograd is about to produce for the unit (freed when they are shipped)."""
        if not unit.grads_charged:
            self._make_room(unit, unit.grad_bytes)  # the budget's guarantee (check_budgets) covers computing units
            unit.grads_charged = unit.grad_bytes
            self.meter.charge(unit.grad_bytes)

    def _uncharge_grads(self, unit: OffloadUnit, packing: Transfer | None = None) -> None:
        """Stop counting the unit's `param.grad`s: now, or once `packing` (their copy off the device) is done."""
        self.meter.uncharge(unit.grads_charged, after=packing)
        unit.grads_charged = 0

    def on_grad(self, unit: OffloadUnit, index: int) -> None:
        self._enter_backward()
        unit.got.add(index)
        self._maybe_finish(unit)

    def on_unit_inputs_grad(self, unit: OffloadUnit) -> None:
        unit.open_calls -= 1
        self._maybe_finish(unit)

    def _maybe_finish(self, unit: OffloadUnit) -> None:
        if unit.awaiting_backward and unit.open_calls <= 0 and len(unit.got) == len(unit.trainable):
            self._finish_backward(unit)

    def _finish_backward(self, unit: OffloadUnit) -> None:
        self._uncharge_grads(unit, packing=ship_grads(self, unit))
        if self.steps_in_flat(unit) and any(unit.has_grad):
            unit.master_in_flat = True  # stays materialised: stepped in place, then used by the next forward
        else:
            self.release(unit)
        unit.reset_backward()
        if self.early_step is not None and any(unit.has_grad):
            self.early_step(unit)

    def submit_early_step(self, unit: OffloadUnit, run) -> None:
        """Run `run()` (one unit's optimizer step) on the step thread once the unit's gradients have landed."""
        pending = unit.grad_pending

        def after_grads() -> None:
            if pending is not None:
                pending.result()
            self.writes.add(run())  # the unit's write-backs, still in flight

        self._early_steps.append(self.step_worker.submit(after_grads))

    def wait_early_steps(self) -> None:
        """Wait for the units stepped during backward (not for their write-backs)."""
        steps, self._early_steps = self._early_steps, []
        for f in steps:
            f.result()

    def wait_writes(self) -> None:
        """Block until every optimizer write-back has reached its tier; raise the first failure."""
        self.writes.wait()
        for unit in self.units.values():
            if unit.refresh is not None:
                self.mover.sync(unit.refresh)
                unit.refresh = None

    def _end_of_backward(self) -> None:
        for unit in self.units.values():
            if unit.awaiting_backward or unit.got:
                self._finish_backward(unit)
        for unit in self.units.values():
            self._uncharge_grads(unit)
        self.release_all(keep_stepping=True)  # prefetches the step did not use
        self.early_step = None  # step_during_backward covers one backward
        self.preload_step = False  # so does preload_during_backward
        self.schedule.end(Phase.BACKWARD)
        self.phase = Phase.IDLE
        self._in_backward = False
        self.backwards += 1
        self._time("backward_s", self._t_bwd)

    # ---- gradients -------------------------------------------------------------------------------------------

    def wait_grads(self) -> None:
        """Block until every gradient shipped so far has reached its tier."""
        for unit in self.units.values():
            if unit.grad_pending is not None:
                unit.grad_pending.result()
                unit.grad_pending = None
        self.meter.settle()  # a unit's gradients have landed, so their pack is done

    def zero_grad(self) -> None:
        self.wait_grads()
        self.wait_early_steps()
        for unit in self.units.values():
            # What was held for a step (gradients, master and moments loaded ahead) goes; params stay for the next
            # forward (a step's updated params, or a fetch's copy of values no step changed).
            self.cache.drop(unit.name, keep=(PARAMS,))
            unit.has_grad = [False] * len(unit.trainable)
            unit.grad_norms = [None] * len(unit.trainable)
            unit.grads_to(GradsState.EMPTY)

    def locate(self, p: torch.Tensor) -> "tuple[OffloadUnit, int] | None":
        """(unit, index into unit.trainable) of a trainable parameter of this model; None if frozen."""
        return self._slot_of.get(id(p))

    def grad_norms_in_model_order(self) -> list[torch.Tensor]:
        return [u.grad_norms[i] for u, i in self._param_order if u.has_grad[i]]

    def step_order(self) -> list[OffloadUnit]:
        """Units in the order the optimizer steps them: backward order (their gradients are ready first)."""
        names = Schedule._distinct(self.schedule.order[Phase.BACKWARD])
        names += [n for n in reversed(list(self.units)) if n not in names]
        return [self.units[n] for n in names]

    # ---- introspection ---------------------------------------------------------------------------------------

    def _time(self, key: str, t0: float | None) -> None:
        if t0 is not None:
            self._timers[key] = self._timers.get(key, 0.0) + time.perf_counter() - t0

    def timings(self) -> dict[str, float]:
        """Accumulated seconds since the last `reset_timings`: forward_s, backward_s (wall), params_wait_s (the
        main thread blocked on parameter fetches), grad_accumulate_s (grad worker), optimizer_s (step compute),
        optimizer_io_wait_s (step blocked on loads/writes), optimizer_wall_s; plus the disk store's stats."""
        out = dict(self._timers)
        if Tier.NVME in self.stores:
            out["nvme"] = self.stores[Tier.NVME].stats()
        return out

    def reset_timings(self) -> None:
        self._timers.clear()

    def memory_report(self) -> dict:
        """Bytes per tier (in use and peak) and, per unit, bytes and placement of each state."""
        disk = self.stores.get(Tier.NVME)
        return {
            "device": {"in_use": self.device_in_use, "peak": self.device_peak, "budget": self.placement.device_budget},
            "host": {"tier": self.stores[Tier.HOST].bytes, "staging": self.pool.bytes, "staging_peak": self.pool.peak,
                     "budget": self.placement.host_budget},
            "nvme": {"bytes": disk.disk_bytes if disk else 0, "budget": self.placement.nvme_budget},
            "units": {u.name: self.unit_report(u) for u in self.units.values()},
        }

    @staticmethod
    def unit_report(unit: OffloadUnit) -> dict:
        sizes = {State.PARAMS: unit.compute_bytes,
                 State.MASTER: 0 if unit.master_entry == PARAMS else 4 * unit.master_numel,
                 State.GRADS: 4 * unit.spec.train_numel, State.OPTIM: 8 * unit.spec.train_numel}
        return {"numel": unit.spec.numel, "trainable_numel": unit.spec.train_numel,
                "states": {s.value: {"tier": unit.placement.tier(s).value, "where": unit.where[s].value,
                                     "bytes": sizes[s]} for s in State}}

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
            self.wait_early_steps()
            self.wait_writes()
        finally:
            try:
                for fn in self.on_close:
                    fn()
            finally:
                remove_hooks(self, self._handles)
                self.cache.clear()
                self.grad_worker.shutdown(wait=True)
                self.step_worker.shutdown(wait=True)
                self.mover.close()
                for store in self.stores.values():
                    store.close()
                self.pool.clear()
                model = self.model
                if model is not None:
                    _ENGINES.pop(model, None)
