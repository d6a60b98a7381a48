"""ZeRO-3 over the offload engine: each unit's compute params kept by one rank, sent to every rank for each use.

[Note: parameters sent for each use] Under `--strategy zero3 --offload host|nvme` a unit one rank owns (the owners
of sharded_optimizer.py: the master, moments and gradients are that rank's alone, as under zero2) also has its
compute params on that rank's tiers only (`Placement.exchanged`, `UnitSize.holds_params`): every rank holds 1/N of
every state. Each time a unit computes (its forward; its backward, unless its params stayed on the device since its
forward), its owner reads them from its tier into one of this exchange's host buffers and broadcasts them, and every
rank (the owner too) fills the unit's device buffer from that host buffer, as a fetch would from its tier
(`Residency`, whose `_start_fetch` asks `source`). So a rank reads its own units from its disk once per use, for
all ranks, and the link to the device carries what it carries in one process. DeepSpeed's ZeRO-3 all-gathers each
parameter's N shards for each use; here the unit is the shard, as it is what the engine moves.

A broadcast is collective: every rank must make the same broadcasts in the same order. The order is that of the
uses, which every rank sees alike (each rank runs the same model on as many micro-batches): `visit` is called as a
unit starts computing, from the engine's `materialise`, and calls of one unit in a row are one use (a unit-major
pass computes a unit's micro-batches back to back; a recomputed forward follows its backward's start). Ahead of
them, the exchange requests the next `EXCHANGE_AHEAD` uses of the phase as the last phase of its kind ran them (a
fixed count, not the plan's prefetch depth, which differs per rank), so the broadcasts run beside the compute; a
use that differs from that record drops what was requested ahead (every rank drops alike) and asks for its own.

Deadlock-free by construction: the exchange thread waits only for a free buffer, for this rank's own step of a unit
(queued before the use was requested, never waiting for the exchange) and for its peers' exchange threads; buffers
go back as the uses move on, which no broadcast waits for ([Note: jobs and grants]: reserve before you start).
There are `EXCHANGE_SLOTS` buffers for the blocks (the uses requested ahead, the use computing and the one whose copy
to the device is finishing), each the largest exchanged block's compute params, and one of the root's, which a phase
uses once, first (`memory_model.exchange_buffer_bytes`, in the plan).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from tightfit.offload.memory_model import EXCHANGE_AHEAD, EXCHANGE_SLOTS
from tightfit.parallel.sharded_optimizer import STRICT_DELAY_S, owner_of
from tightfit.parallel.wire import Wire


class _Use:
    """One use of a unit's params: requested, filled by the exchange thread, given back once the use is over."""

    __slots__ = ("unit", "src", "step", "future", "slot", "reader", "given_back")

    def __init__(self, unit, src: int) -> None:
        from concurrent.futures import Future

        self.unit, self.src = unit, src
        self.step = unit.stepping  # the owner's step the values must follow (queued before this use was asked for)
        self.future: Future = Future()  # the values (a view of `slot`), or the exchange's error
        self.slot: torch.Tensor | None = None
        self.reader = None  # a copy to the device reading `slot` (the mover's Transfer)
        self.given_back = False

    @property
    def values(self) -> torch.Tensor:
        """The unit's params for this use (a view of `slot`); raises the exchange's error."""
        return self.future.result()


class ParamsExchange:
    """The exchange of one rank's engine: `engine.exchange`, asked by its `materialise` and `Residency`. `owner`:
    block name -> rank (sharded_optimizer.owners); `group`: a process group of the exchange's own.
    `collective(what)`: labels a wait that a lost peer would end."""

    def __init__(self, engine, owner: dict[str, int], group,
                 collective: Callable[[str], ContextManager] = lambda what: nullcontext()) -> None:
        from tightfit.offload.runtime.aligned import aligned_empty

        self.engine, self.group, self.collective = engine, group, collective
        self.rank = dist.get_rank(group)
        self.owner = {u.name: r for u in engine.units.values()
                      if u.exchanged and (r := owner_of(u.name, owner)) is not None}
        cuda = engine.device.type == "cuda"
        self.wire = Wire(engine, group, max((engine.units[n].spec.numel for n in self.owner), default=0))
        # Free buffers: the root's one (used once a forward phase), the blocks' EXCHANGE_SLOTS of the largest
        # block; page-locked on a GPU, which copies from them
        self._free: dict[bool, queue.Queue] = {True: queue.Queue(), False: queue.Queue()}  # is root -> its buffers
        for root in (True, False):
            numels = [engine.units[n].spec.numel for n in self.owner if engine.units[n].spec.is_root == root]
            for _ in range((1 if root else EXCHANGE_SLOTS) if numels else 0):
                self._free[root].put(aligned_empty(max(numels), engine.compute_dtype, pin=cuda))
        self._requests: queue.Queue = queue.Queue()
        self._ahead: dict[str, deque[_Use]] = defaultdict(deque)  # requested, its use not begun, per unit
        self._current: _Use | None = None  # the use computing (its buffer kept until the next use begins)
        self._seen: dict = {}  # phase -> the units' uses the last phase of that kind ran, in order
        self._phase = None
        self._uses: list[str] = []  # this phase's uses so far
        self._predicted: list[str] | None = None  # this phase's uses as the last of its kind ran them
        self._requested = 0  # of `_predicted`, the uses requested
        self.bytes = 0  # compute-dtype values sent or received
        self.seconds = 0.0  # the exchange thread's time in its broadcasts
        self.uses = 0  # uses begun (`visit`)
        self.broadcasts = 0  # broadcasts done: the uses, and those asked for ahead and dropped
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tightfit-params", daemon=True)
        self._thread.start()

    # ---- the engine's side (the thread running forward and backward) ---------------------------------------------

    def begin(self, phase) -> None:
        """A forward or a backward phase starts: what the last one requested ahead and did not use is dropped, and
        this one's first uses are requested as the last phase of its kind ran them."""
        if self._phase is not None and self._uses:
            self._seen[self._phase] = self._uses
        self._drop_ahead()
        self._phase, self._uses = phase, []
        self._predicted, self._requested = self._seen.get(phase), 0
        self._request_ahead(0)

    def visit(self, unit) -> None:
        """`unit` starts computing (`OffloadEngine.materialise`); calls of one unit in a row are one use."""
        if self._uses and self._uses[-1] == unit.name:
            return
        pos = len(self._uses)
        self._uses.append(unit.name)
        self.uses += 1
        predicted = self._predicted is not None and pos < len(self._predicted) and self._predicted[pos] == unit.name
        if not predicted:  # not the recorded order: what was asked ahead is not what comes (on every rank alike)
            self._drop_ahead()
            self._predicted = None
        if not self._ahead[unit.name]:
            self._request(unit)
        previous, self._current = self._current, self._ahead[unit.name].popleft()
        if previous is not None:
            self._give_back(previous)
        if self._predicted is not None:
            self._requested = max(self._requested, pos + 1)
            self._request_ahead(pos + 1)

    def source(self, unit, wait: bool) -> _Use | None:
        """The use a fetch of `unit` copies from (its `values`): the use computing, else its next use requested;
        waited for (`wait`), or None when not here yet (a prefetch comes back later). The fetch sets its `reader`."""
        use = self._current if self._current is not None and self._current.unit is unit else None
        if use is None:
            use = self._ahead[unit.name][0] if self._ahead[unit.name] else None
        if use is None or not (wait or use.future.done()):
            return None
        if not use.future.done():
            with self.collective(f"the exchange of {unit.name}'s parameters (ZeRO-3)"):
                use.future.result()
        return use

    def close(self) -> None:
        """Stop the thread once what was requested is done (every rank requested the same); what was asked ahead
        and not used gives its buffer back first, so a request behind it does not wait for one forever."""
        self._drop_ahead()
        self._requests.put(None)
        self._thread.join()

    # ---- requests and buffers -----------------------------------------------------------------------------------

    def _request(self, unit) -> None:
        use = _Use(unit, self.owner[unit.name])
        self._ahead[unit.name].append(use)
        self._requests.put(use)

    def _request_ahead(self, pos: int) -> None:
        """Request the predicted uses up to `EXCHANGE_AHEAD` past `pos`."""
        if self._predicted is None:
            return
        while self._requested < min(len(self._predicted), pos + EXCHANGE_AHEAD):
            self._request(self.engine.units[self._predicted[self._requested]])
            self._requested += 1

    def _drop_ahead(self) -> None:
        """Give back every use requested and not begun, and the use computing."""
        for uses in self._ahead.values():
            while uses:
                self._give_back(uses.popleft())
        if self._current is not None:
            self._give_back(self._current)
            self._current = None

    def _give_back(self, use: _Use) -> None:
        """The use's buffer back to the free ones, once it is filled and no copy reads it."""
        def back(_f=None) -> None:
            if use.reader is not None and not use.reader.done.done():
                use.reader.done.add_done_callback(back)
                return
            if use.slot is not None and not use.given_back:
                use.given_back = True
                self._free[use.unit.spec.is_root].put(use.slot)

        use.future.add_done_callback(back)

    # ---- the exchange thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Each use requested, in order: a free buffer; the owner reads the unit's params into it (after its step)
        and broadcasts them, every other rank receives them."""
        from tightfit.offload.runtime.movers import strict_from_env, strict_seed

        late = random.Random(strict_seed() + 5 + self.rank) if strict_from_env() else None
        while True:
            use = self._requests.get()
            if use is None:
                return
            if self._error is not None:
                use.future.set_exception(self._error)
                continue
            try:
                if late is not None:
                    time.sleep(late.uniform(0.0, STRICT_DELAY_S))
                unit = use.unit
                use.slot = self._free[unit.spec.is_root].get()
                values = use.slot[:unit.spec.numel]
                started = time.perf_counter()
                if use.src == self.rank:
                    if use.step is not None:
                        use.step.result()
                    write = unit.flat_write  # a step in place still writing its params back (read once)
                    if write is not None:
                        write.result()
                    self.engine.read_params(unit, values, after_step=False)
                self.wire.broadcast(values, use.src)
                self.seconds += time.perf_counter() - started
                self.bytes += values.numel() * values.element_size()
                self.broadcasts += 1
                use.future.set_result(values)
            except BaseException as e:  # noqa: BLE001 - the use waiting for it raises it, and every later one
                self._error = e
                use.future.set_exception(e)


def exchange_params(engine, owner: dict[str, int], group, collective=None) -> ParamsExchange:
    """Attach a `ParamsExchange` to `engine` (wrapped with `Placement.exchanged`): from now on its exchanged units'
    params come through it. Closed with the engine."""
    exchange = ParamsExchange(engine, owner, group, collective or (lambda what: nullcontext()))
    engine.attach_exchange(exchange)
    engine.on_close.append(exchange.close)
    return exchange
