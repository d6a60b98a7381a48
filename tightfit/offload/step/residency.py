"""Which units' params are on the device: fetched when a unit computes or ahead of it, released when it is done,
all under the device budget.

Why apart from the engine: this is the device half of the scheduler's moves ([Note: moves], scheduler.py) and of
the lifecycle's params state (lifecycle.py), with its own collaborators: the device meter (the budget), the mover,
the pool that grants a disk fetch its staging buffer, and the host cache that may hold a copy to fetch from. The
engine says *when* (its hook events); this says *how*, and whether a move fits now.

[Note: device budget] (runtime/device_meter.py) A prefetch starts only when its unit fits; materialising a needed
unit first evicts units that are not computing, then waits for gradient copies still running; if it still does not
fit, that is a UsageError naming the budget.
"""

from __future__ import annotations

import time
from typing import Callable

from tightfit.errors import UsageError
from tightfit.offload.runtime.device_meter import DeviceMeter
from tightfit.offload.runtime.futures import all_done
from tightfit.offload.runtime.host_cache import Held, HostCache
from tightfit.offload.runtime.host_memory import Grant, HostPool
from tightfit.offload.runtime.workers import Timers
from tightfit.offload.step.lifecycle import Event, ParamsState
from tightfit.offload.step.unit import PARAMS, OffloadUnit
from tightfit.utils.sizes import format_size


class Residency:
    """The units materialised on the device, and the moves that change it.

    keeps_master(unit): does a fetch starting now keep its host copy as the unit's step master ([Note: master from
    the fetch], unit.py)? The engine answers: it knows the phase and the declared step. phase(): the model's step
    phase, for the meter's count of host waits."""

    def __init__(self, units: dict[str, OffloadUnit], meter: DeviceMeter, mover, pool: HostPool, cache: HostCache,
                 timers: Timers, device_budget: int | None, keeps_master: Callable[[OffloadUnit], bool],
                 phase: Callable[[], object]) -> None:
        self.units = units
        self.meter = meter
        self.mover = mover
        self.pool = pool
        self.cache = cache
        self.timers = timers
        self.device_budget = device_budget
        self.keeps_master = keeps_master
        self.phase = phase
        self.active: set[str] = set()  # units materialised because they compute now (not mere prefetches)
        self.exchange = None  # ZeRO-3: where exchanged units' params come from (OffloadEngine.attach_exchange)

    def make_room(self, keep: OffloadUnit, nbytes: int) -> bool:
        """Evict idle units, then wait for gradients still being packed, until `nbytes` fit; whether they do."""
        if self.meter.fits(nbytes):
            return True
        self.evict_idle(keep)
        if not self.meter.fits(nbytes) and self.meter.packing:
            self.meter.settle(wait=True, phase=self.phase())
        return self.meter.fits(nbytes)

    def wait_refresh(self, unit: OffloadUnit) -> None:
        """A resident unit's new compute params from its last step, on their way up, are there."""
        if unit.refresh is not None:
            self.mover.wait(unit.refresh)
            unit.refresh = None

    def materialise(self, unit: OffloadUnit) -> None:
        """The unit computes now: its params on the device, waiting for the fetch in flight or fetching now."""
        self.active.add(unit.name)
        self.wait_refresh(unit)
        state = unit.params_state
        if state in (ParamsState.RESIDENT, ParamsState.READY):
            return
        if state == ParamsState.KEPT_FOR_STEP:  # stepped in place: the next forward uses them as they are
            unit.life.on(Event.FETCHED)
            return
        t0 = time.perf_counter()
        if state == ParamsState.RELEASED:
            if not self.make_room(unit, unit.compute_bytes):
                raise UsageError(
                    f"device budget {format_size(self.device_budget)} exceeded materialising unit "
                    f"{unit.name!r} ({format_size(unit.compute_bytes)}; "
                    f"{format_size(self.meter.in_use)} in use); raise --gpu-mem or lower prefetch_depth")
            self.meter.charge(unit.compute_bytes)
            self._start_fetch(unit, firm=True)
        unit.finish_fetch(self.mover)
        self.timers.since("params_wait_s", t0)

    def fetch_ahead(self, name: str) -> bool:
        """The scheduler's FETCH move: start the unit's params if the device and the pool have room now."""
        unit = self.units[name]
        if unit.resident or unit.on_device:
            return True
        if unit.stepping is not None and not unit.stepping.done():
            return False  # its step is still writing its params: fetched once it is (materialise waits for it)
        if not self.meter.fits(unit.compute_bytes):
            return False
        self.meter.charge(unit.compute_bytes)
        if not self._start_fetch(unit, firm=False):
            self.meter.uncharge(unit.compute_bytes)
            return False
        return True

    def _start_fetch(self, unit: OffloadUnit, firm: bool) -> bool:
        """Start the unit's params towards the device: from a copy the host cache holds, else from their tier through
        the fetch job's staging buffer ([Note: jobs and grants]). firm: the unit computes now, wait for the buffer;
        else (a prefetch) only if the pool has room now. Whether it started."""
        if unit.exchanged and self.exchange is not None:  # sent by its owner for this use (params_exchange.py)
            use = self.exchange.source(unit, wait=firm)
            if use is None:
                return False
            unit.start_fetch(self.mover, source=use.values)
            use.reader = unit.fetch  # the use's buffer goes back once this copy is done
            return True
        held = self.cache.take(unit.name, PARAMS, unit.version) if unit.master_entry == PARAMS else None
        if held is not None and held.prefix is not None:  # part of the params only: not for a fetch
            held.release()
            held = None
        if held is not None:
            if held.ready is not None:  # a master preloaded for a step that did not come: its read first
                held.ready.result()
            unit.start_fetch(self.mover, source=held.buf)
            if self.keeps_master(unit):  # stays, as the master of the unit's step, once the copy has read it
                self.cache.put(unit.name, PARAMS, Held(held.grant, unit.version,
                                                       reading=all_done([unit.fetch.done, held.reading])))
            else:
                held.grant.release(after=[unit.fetch.done, held.reading])
            return True
        if "fetch" not in unit.jobs:
            unit.start_fetch(self.mover)
            return True
        job, sizes = f"fetch {unit.name}", unit.jobs["fetch"]
        grant = self.pool.reserve(job, sizes) if firm else self.pool.try_reserve(job, sizes)
        if grant is None:
            return False
        unit.start_fetch(self.mover, staging=grant[PARAMS])
        t = unit.fetch
        if self.keeps_master(unit):
            unit.keeping_master = True
            version = unit.version
            t.done.add_done_callback(lambda _f: self._kept_master(unit, grant, version, t))
        else:
            grant.release(after=t.done)
        return True

    def _kept_master(self, unit: OffloadUnit, grant: Grant, version: int, t) -> None:
        """A fetch that keeps its staging buffer is done (any thread): the buffer goes to the host cache if the
        speculative bound admits it, else back to the pool."""
        unit.keeping_master = False
        if t.cancelled or t.done.exception() is not None or not grant.speculate():
            grant.release()
            return
        self.cache.put(unit.name, PARAMS, Held(grant, version))

    def evict_idle(self, keep: OffloadUnit) -> None:
        """Release materialised units that are not computing (prefetches, units kept for backward) except `keep`."""
        for other in self.units.values():
            if (other is not keep and other.on_device and not other.resident and other.name not in self.active
                    and other.params_state != ParamsState.KEPT_FOR_STEP):
                self.release(other)

    def idle(self, unit: OffloadUnit) -> None:
        """The unit stays materialised but no longer computes: a fetch that needs the room may evict it."""
        self.active.discard(unit.name)

    def release(self, unit: OffloadUnit) -> None:
        self.active.discard(unit.name)
        if unit.resident or not unit.on_device:
            return
        unit.free(self.mover)
        self.meter.uncharge(unit.compute_bytes)

    def release_all(self, keep_stepping: bool = False) -> None:
        """Release every materialised unit; keep_stepping: except a root whose step runs in place."""
        for unit in self.units.values():
            if not (keep_stepping and unit.params_state == ParamsState.KEPT_FOR_STEP):
                self.release(unit)
