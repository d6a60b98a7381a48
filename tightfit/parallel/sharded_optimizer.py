"""ZeRO-1 and ZeRO-2 over the offload engine: `--strategy zero1|zero2 --offload host|nvme` on several ranks.

[Note: optimizer states sharded by unit] The replicas of parallel/replicas.py each hold every state of the whole
model: at 16 bytes a parameter of fp32 master, gradients and moments, a 70B model is 1.1 TB per rank whatever the
number of ranks. Here each trainable unit (a block, the root) has one owner among the data-parallel ranks
(`owners`: largest first to the least loaded rank), and only its owner holds its fp32 master and Adam moments
(where the compute copy is not itself the fp32 master) and steps it; every other rank plans, allocates and keeps
neither (`Placement.stepped_elsewhere`; the memory model's `UnitSize.stepped`), so master and moments cost each rank
1/N of the model's, on whichever tier its own plan puts them. Under zero1 the gradients stay whole on every rank,
averaged as the replicas average them (so the global norm a clip needs is every rank's own, bit for bit alike);
under zero2 each unit's gradients are reduced to its owner as they leave the device and the others keep none
(`Placement.grads_elsewhere`, `UnitSize.keeps_grads`), and the clip's per-parameter norms are summed over the ranks
(`UnitOwners.norms_over_ranks`: one rank holds each, the others zeros, so the sum is each norm bit for bit). The
compute params stay whole on every rank: each runs the whole forward and backward, as in DeepSpeed's ZeRO-1/2.

After the optimizer step (`opt.step()` queues this rank's units on the engine's step thread), the exchange hands
every rank the new values: unit by unit, in the engine's unit order (the same on every rank), the owner waits for
its unit's step, reads its compute copy (the fp32 master cast by its step, or the fp32 params themselves) and
broadcasts it over a process group of the exchange's own; every other rank writes it into its tiers as the unit's
compute copy (`OffloadEngine.write_params`), the only copy it keeps of another rank's unit. So every rank holds the
values the replicas would, bit for bit, and the exchange moves the compute dtype's bytes (2 a parameter in bf16).
DeepSpeed's ZeRO-1/2 all-gather the updated partitions the same way; the unit is the partition here because it is
what the engine steps and moves.

[Note: the exchange under the next forward] The exchange runs on a thread of its own (`UnitOwners.start`), beside
the next forward, as the units' own steps run on the step thread: before it starts, each unit another rank steps is
marked `stepping` with a future its arrival completes, so the forward waits where it reaches such a unit and only
until that unit's values are here (the engine's `materialise` waits for a stepping unit; no prefetch of it starts
before), exactly as it waits for one of its own units' steps. The exchange's wait for this rank's own steps is on
that thread, not the forward's. What the forward waited for is counted as `optimizer_exposed_s`. Nothing else uses
the exchange's group while it runs: the norms' exchange, the checkpoints' gathers and `close` join it first.
Deadlock-free: the exchange thread waits only for this rank's steps (which finish on their own: [Note: jobs and
grants]) and for the peers' exchange threads, which wait for the same; never for a forward.

Checkpoints stay the one-process format, written by rank 0: its own units' states from its tiers, the others' sent
to it unit by unit (`Gathered`, `_send_owned`), so one process, another world size, or the replicas resume them;
on resume each rank reads every unit's values and only its own units' moments (state_io.import_state).

Cost, against the replicas: each rank steps 1/N of the units, and the exchange broadcasts the compute dtype's bytes
of every parameter a step, beside the next forward (the plan prices it: planner/averaging.py `exchange_time`). ZeRO-3
shards the compute params too and sends them for each use instead (params_exchange.py), with these owners, zero2's
gradients and norms, and these gathers.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from tightfit.errors import UsageError
from tightfit.parallel.replicas import Replicated
from tightfit.parallel.wire import Wire


STRICT_DELAY_S = 0.01
"""Strict mode: the most the exchange thread waits before each unit's broadcast (TIGHTFIT_STRICT_MOVER)."""


def owners(sizes: list[tuple[str, int]], ranks: int) -> dict[str, int]:
    """Each named unit's owner among `ranks` ranks from its (name, trainable elements): the largest unit first, each
    to the rank that owns the fewest elements so far (the lowest such rank on a tie). The same on every rank: it
    depends on the model alone. Units without trainable elements have no owner (every rank has their values)."""
    load = [0] * ranks
    out: dict[str, int] = {}
    for name, n in sorted((s for s in sizes if s[1] > 0), key=lambda s: (-s[1], s[0])):
        r = min(range(ranks), key=lambda k: (load[k], k))
        out[name] = r
        load[r] += n
    return out


def owner_of(name: str, owner: dict[str, int]) -> int | None:
    """The owner of engine unit `name`: its own entry, or the block it is part of (a tile: "blocks.0.mlp.tiles.1"),
    None when no rank owns it alone (every rank steps it, as `Placement.steps_here` says for it)."""
    if name in owner:
        return owner[name]
    found = [k for k in owner if name.startswith(k + ".")]
    return owner[max(found, key=len)] if found else None


class UnitOwners:
    """Makes `engine` one rank of a group whose optimizer states are sharded by unit (`owner`: block name -> rank),
    the engine wrapped with `Placement.stepped_elsewhere` (and, for "zero2", `grads_elsewhere`) as `shard_setup`
    says and its gradients averaged by `averager` (replicas.average_over_ranks). `group`: the exchange's and the
    norms' process group. A loop calls `start()` after each `opt.step()` and `join()` before its own next
    collective on `group`; `tightfit train` does (`ShardedOptimizer`), and so can a user's own loop.
    `collective(what)`: a context naming the collective calls inside it (the run's World labels them for a lost
    peer's message)."""

    def __init__(self, engine, owner: dict[str, int], averager, group, strategy: str = "zero1",
                 collective: Callable[[str], ContextManager] = lambda what: nullcontext()) -> None:
        self.engine, self.owner, self.group, self.strategy = engine, owner, group, strategy
        self.rank = dist.get_rank(group)
        self.collective = collective
        # (unit, owner) of every unit one rank steps for all, in the engine's unit order (every rank's)
        self.units = [(u, r) for u in engine.units.values()
                      if u.trainable and (r := owner_of(u.name, owner)) is not None]
        # The new values' way across ([Note: the wire's device buffer] in wire.py; ZeRO-3 sends each use's through
        # its own exchange instead); the norms' tensors are where the wire is: the host on gloo, the GPU on NCCL
        self.wire = Wire(engine, group, max((u.spec.numel for u, _ in self.units), default=0)
                         if strategy != "zero3" else 0)
        self._norms_here: dict[str, bool] = {}  # unit name -> this rank adds its norms to the clip's sum
        if strategy in ("zero2", "zero3"):  # each unit's gradients to its owner alone; the norms from every rank
            averager.owner_of = lambda name: owner_of(name, owner)
            engine.norms_over_ranks = self.norms_over_ranks
        self.bytes = 0  # compute-dtype values sent or received in the exchanges started
        self.seconds = 0.0  # the exchange thread's time, beside the forward
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffer: torch.Tensor | None = None  # the exchange's host buffer (its largest unit's values)

    def norms_over_ranks(self, norms: list[torch.Tensor], units: list) -> list[torch.Tensor]:
        """Every rank's list of per-parameter gradient norms (`units[k]`: the unit of `norms[k]`), each rank holding
        those of its own units and zeros for the others' (ZeRO-2): their sum over the ranks, where exactly one term is
        not zero, is every norm bit for bit, so every rank clips by the coefficient the replicas would. A unit no
        rank owns alone (every rank holds its gradients) counts rank 0's norm only."""
        self.join()  # the exchange's group is the norms'
        stacked = torch.stack([n.to(self.wire.device, torch.float32) if self._adds_norms(u.name)
                               else torch.zeros((), device=self.wire.device) for n, u in zip(norms, units)])
        with self.collective("the gradient norms' exchange"):
            dist.all_reduce(stacked, group=self.group)
        return list(stacked.unbind())

    def _adds_norms(self, name: str) -> bool:
        """Does this rank add unit `name`'s gradient norms to the clip's sum? Its own units', and rank 0 those of a
        unit every rank holds (remembered: asked every step)."""
        here = self._norms_here.get(name)
        if here is None:
            r = owner_of(name, self.owner)
            here = self._norms_here[name] = r == self.rank or (r is None and self.rank == 0)
        return here

    def start(self) -> None:
        """Start the exchange of the step just queued (after `opt.step()`) on a thread of its own, and return: each
        unit another rank steps is `stepping` until its values are here, so the next forward waits for that unit's
        values alone, as it waits for a unit's own step ([Note: the exchange under the next forward])."""
        from concurrent.futures import Future

        self.join()
        units = self.units
        if self._buffer is None and units:  # kept from step to step: one unit's values at a time pass through it
            from tightfit.offload.runtime.aligned import aligned_empty

            self._buffer = aligned_empty(max(u.spec.numel for u, _ in units), self.engine.compute_dtype)
        arrivals: dict[str, Future] = {}
        for unit, r in units:
            if r != self.rank:  # set before the next forward can ask: it waits, and no prefetch starts before
                arrivals[unit.name] = unit.stepping = Future()
        self.bytes += sum(u.spec.numel for u, _ in units) * self.engine.compute_dtype.itemsize  # this step's
        self._thread = threading.Thread(target=self._run, args=(units, arrivals), name="tightfit-exchange",
                                        daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the exchange in flight; its error, if it failed, raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self, units: list, arrivals: dict) -> None:
        """The exchange thread: unit by unit in the engine's order (every rank's), the owner's compute copy once its
        step is done, broadcast; each arrival written and its unit released to the forward."""
        from tightfit.offload.runtime.movers import strict_from_env, strict_seed

        # The strict mode's random delays (the test suite's): arrivals late, so the forward waits for them
        late = random.Random(strict_seed() + 3 + self.rank) if strict_from_env() else None
        t0 = time.perf_counter()
        try:
            with self.collective("the exchange of the stepped units' values"):
                for unit, r in units:
                    if late is not None:
                        time.sleep(late.uniform(0.0, STRICT_DELAY_S))
                    started = time.perf_counter()
                    values = self._buffer[:unit.spec.numel]
                    if r == self.rank:
                        step = unit.stepping  # the forward may clear it once done: read once
                        if step is not None:
                            step.result()
                        self.engine.read_params(unit, values, after_step=False)
                    self.wire.broadcast(values, r)
                    if r != self.rank:
                        self.engine.write_params(unit, values)
                        arrivals.pop(unit.name).set_result(started)
        except BaseException as e:  # noqa: BLE001 - the forward waiting on a unit raises it; so does `join`
            self._error = e
            for f in arrivals.values():
                f.set_exception(e)
        finally:
            self.seconds += time.perf_counter() - t0


class ShardedOptimizer(Replicated):
    """This rank's whole model through its engine, stepping only the units it owns (`owner`: block name -> rank):
    `tightfit train`'s trainee for `--strategy zero1|zero2` with the offload engine. `group`: the exchange's process
    group; `gather_group`: a gloo group for the checkpoints' gathers where `group` is NCCL's."""

    def __init__(self, inner, world, averager, swap, made, owner: dict[str, int], group, strategy: str,
                 gather_group) -> None:
        super().__init__(inner, world, averager, swap, made)
        from tightfit.offload.step.engine import find_engine

        self.strategy = strategy
        self.engine = find_engine(inner.model)
        self.shard = UnitOwners(self.engine, owner, averager, group, strategy, world.collective)
        self._export_gather: Gathered | None = None  # rank 0's gather of an export in progress
        self.gather_group = gather_group

    def arrangement(self) -> str:
        mine = sum(1 for _, r in self.shard.units if r == self.world.rank)
        held = {"zero1": "master and moments", "zero2": "master, moments and gradients",
                "zero3": "parameters, master, moments and gradients"}[self.strategy]
        grads = ("gradients averaged" if self.strategy == "zero1" else "each unit's gradients reduced to its rank")
        return (f"each rank steps its own units, {mine} of them on rank 0, and holds their {held} alone; rank 0's "
                f"plan below; {grads} as they leave the device")

    def evaluate(self, batches) -> float:
        """As the replicas, each rank its round-robin share; under zero3 every rank runs as many forwards (each use's
        parameters are a broadcast every rank joins): a rank with a shorter share runs the first batch again, weight
        0."""
        if self.strategy != "zero3":
            return super().evaluate(batches)
        from tightfit.train.trainee import OneProcess

        mine = batches[self.world.rank::self.world.size]
        forwards = -(-len(batches) // self.world.size)
        losses = [OneProcess.evaluate(self, [b]) for b in mine + batches[:1] * (forwards - len(mine))]
        return self._mean_over_ranks(sum(losses[:len(mine)]), len(mine))

    def clip_and_step(self, max_norm: float) -> float | None:
        norm = super().clip_and_step(max_norm)
        if self.strategy != "zero3":  # zero3's owners send the new values as each use asks for them
            self.shard.start()
        return norm

    def close(self) -> None:
        """Wait for the exchange in flight (its error was the forward's), then close as the replicas do."""
        try:
            self.shard.join()
        except BaseException:  # noqa: BLE001 - raised already where the forward waited for the unit
            pass
        super().close()

    # ---- checkpoints and exports: rank 0 writes, the owners send ------------------------------------------------

    def _settled(self) -> None:
        """Before a gather: the exchange done (the gathers' group may be its own) and every state at rest."""
        from tightfit.offload.model_state.state_io import quiesce

        self.shard.join()
        quiesce(self.engine)

    def checkpoint_groups(self, hand_over: bool = False):
        self._settled()
        if self.world.is_main:
            return self._gathered(True, hand_over)
        self._send_owned(True, hand_over)
        return None

    def export_tensors(self):
        """On rank 0, every unit's values and state, the other owners' sent to it (rank 0 alone calls this, from
        `export_hf`: `_send_owned` is its other ranks' side)."""
        self._settled()
        self._export_gather = gathered = self._gathered(True, False, pieces=True)  # tensors, not swap copies
        for _, items in gathered:
            yield from items

    def export_hf(self, folder, meta_model, check_finite: bool = False, merge_lora: bool = False) -> None:
        from tightfit.train.trainee import OneProcess

        failed = None
        if self.world.is_main:  # the whole model's values: its own units' from its tiers, the others' sent
            try:
                OneProcess.export_hf(self, folder, meta_model, check_finite, merge_lora)
            except Exception as e:  # noqa: BLE001 - raised in the vote, after every rank has heard of it
                failed = e
            finally:  # an export stopped early (a non-finite weight) still takes what the other ranks send
                if self._export_gather is not None:
                    self._export_gather.close()
                    self._export_gather = None
        else:
            self._settled()
            self._send_owned(True, False)
        self._export_voted(failed)

    def _gathered(self, with_optim: bool, hand_over: bool, pieces: bool = False) -> "Gathered":
        return Gathered(self.engine, self.shard.units, with_optim, hand_over, self.gather_group, pieces)

    def _send_owned(self, with_optim: bool, hand_over: bool) -> None:
        send_owned(self.engine, self.shard.units, self.world.rank, with_optim, self.gather_group, hand_over)

    def engine_counters(self):
        counters = super().engine_counters()
        if counters is not None:
            params = self.engine.exchange  # zero3's exchange of each use's params, else the new values' a step
            counters["exchange_bytes"] = float(params.bytes if params is not None else self.shard.bytes)
            counters["exchange_s"] = params.seconds if params is not None else self.shard.seconds
        return counters


class Gathered:
    """Rank 0's side of a gather: (group, [(key, tensor)]) of every unit in the engine's order, its own read from its
    tiers (train/checkpoint_swap.py), the others' received from their owners (`_receive`). Dropped or closed before
    the end (the save or the export failed, or never started), it still receives what the owners send, so that no
    rank is left waiting in a send."""

    def __init__(self, engine, owned: list, with_optim: bool, hand_over: bool, group, pieces: bool = False) -> None:
        self.with_optim, self.group = with_optim, group
        self._pending = [(u, r) for u, r in owned if r != 0]  # still to receive, in order
        # The generator holds the pending list, not this object, so that dropping this object drains at once
        self._items = _gather(engine, {u.name: r for u, r in owned}, with_optim, hand_over, group, self._pending,
                              pieces)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        self._items.close()
        while self._pending:
            unit, r = self._pending.pop(0)
            _receive(unit, r, self.with_optim, self.group)

    def __del__(self) -> None:
        self.close()


def _gather(engine, owner: dict, with_optim: bool, hand_over: bool, group, pending: list, pieces: bool):
    """`Gathered`'s items: rank 0's own units from its tiers, the others' received (each popped from `pending`).
    `pieces`: rank 0's own as (unit, [(key, tensor)]) pieces too, never as a copy of its swap files (what a writer of
    tensors, not of checkpoint shards, takes)."""
    from tightfit.offload.model_state.state_io import export_pieces
    from tightfit.train.checkpoint_swap import unit_groups

    for unit in engine.units.values():
        r = owner.get(unit.name, 0)
        if r == 0 and pieces:
            for piece in export_pieces(engine, unit, with_optim):
                yield unit.name, piece
        elif r == 0:
            yield from unit_groups(engine, unit, with_optim, hand_over)
        else:
            pending.pop(0)
            yield unit.name, _receive(unit, r, with_optim, group)


def send_owned(engine, owned: list, rank: int, with_optim: bool, group, hand_over: bool = False) -> None:
    """Another rank's side of a `Gathered`: its own units' values and state (`owned`: every (unit, owner) in the
    engine's order) to rank 0; `hand_over`: each unit's swap files dropped once sent (the run's last save)."""
    from tightfit.train.checkpoint_swap import drop_swap

    for unit, r in owned:
        if r == rank:
            _send(engine, unit, with_optim, group)
            if hand_over:
                drop_swap(unit)


def _send(engine, unit, with_optim: bool, group) -> None:
    """A unit's fp32 values and, with `with_optim`, its step counts (-1: never stepped) and moments, to rank 0."""
    from tightfit.offload.placement import State
    from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ

    dist.send(engine.read_master(unit), dst=0, group=group)
    if not with_optim:
        return
    steps = torch.tensor([-1.0 if unit.moments_empty or s is None else float(s) for s in unit.steps],
                         dtype=torch.float32)
    dist.send(steps, dst=0, group=group)
    if bool((steps >= 0).any()):
        for entry in (EXP_AVG, EXP_AVG_SQ):
            moments = torch.empty(unit.spec.train_numel, dtype=torch.float32)
            unit.store[State.OPTIM].load(unit.name, entry, moments).result()
            dist.send(moments, dst=0, group=group)


def _receive(unit, src: int, with_optim: bool, group) -> list[tuple[str, torch.Tensor]]:
    """Rank 0's side of `_send`: the unit's (key, tensor) pairs as `state_io.export_pieces` names them."""
    from tightfit.offload.runtime.aligned import aligned_empty

    master = aligned_empty(unit.spec.numel, torch.float32)
    dist.recv(master, src=src, group=group)
    items = [(f"model.{slot.name}", slot.view(master)) for slot in unit.spec.slots]
    if not with_optim:
        return items
    steps = torch.empty(len(unit.trainable), dtype=torch.float32)
    dist.recv(steps, src=src, group=group)
    if bool((steps >= 0).any()):
        moments = {}
        for entry in ("exp_avg", "exp_avg_sq"):
            moments[entry] = torch.empty(unit.spec.train_numel, dtype=torch.float32)
            dist.recv(moments[entry], src=src, group=group)
        for i, slot in enumerate(unit.trainable):
            if steps[i] < 0:
                continue
            items += [(f"optim.{slot.name}.{entry}", slot.view(moments[entry])) for entry in moments]
            items.append((f"optim.{slot.name}.step", steps[i].clone()))
    return items


def shard_setup(model: torch.nn.Module, rank: int, ranks: int, strategy: str = "zero1"
                ) -> tuple[dict[str, int], frozenset]:
    """(every unit's owner, the units this rank does not step) of `model` as the planner and the engine see its units
    (`find_units`: the root and each block)."""
    from tightfit.offload.step.units import find_units

    specs = find_units(model)
    owner = owners([(s.name, s.train_numel) for s in specs], ranks)
    if ranks > 1 and len(owner) < ranks:
        raise UsageError(f"--strategy {strategy} with the offload engine: the model has {len(owner)} trainable units for "
                         f"{ranks} ranks, so a rank would step none; use fewer ranks or --strategy ddp")
    return owner, frozenset(name for name, r in owner.items() if r != rank)


def shard_averaging(model: torch.nn.Module, rank: int, ranks: int, strategy: str, averaging):
    """(every unit's owner, `averaging` as rank `rank`'s plan prices a `strategy` sharding: the units it does not
    step, under zero2/zero3 their gradients reduced to their owners, under zero3 their params held there alone)."""
    from dataclasses import replace

    owner, elsewhere = shard_setup(model, rank, ranks, strategy)
    return owner, replace(averaging, stepped_elsewhere=elsewhere, grads_elsewhere=strategy in ("zero2", "zero3"),
                          exchanged=frozenset(owner) if strategy == "zero3" else frozenset())
