"""AdamW over FSDP2's shards: each unit's moments in this rank's host memory or its own NVMe folder, each unit stepped
on a thread of its own under the next forward.

Why: under ZeRO-3 FSDP2 (`fully_shard`) owns what it does best — each parameter's dim-0 shard on this rank, the
all-gather before a unit computes, the reduce-scatter of its gradients, their streams — and this optimizer holds the
rest of the rank's training state: the AdamW moments of its local shards (8 of the 16 bytes a parameter), on the tier
given (the one-process engine's stores, offload/tiers/stores.py: host memory, or one safetensors file per unit in the
rank's swap folder). torch's AdamW over FSDP2's CPU offload steps the whole model after the backward while the GPU
waits; here `step()` queues the units in the order the next forward needs them and returns, and a unit's forward
waits only for its own step.

[Note: steps under the next forward, on FSDP2's shards]
- A unit's step reads its local shards' gradients and writes its local parameter shards in place. FSDP2 reads those
  shards next in that unit's all-gather, which runs in FSDP2's forward pre-hook; ours is registered in front of it
  (`prepend`), after `fully_shard`, and waits for the unit's step. Nothing else reads a unit's shards in between:
  the loop's next calls are `zero_grad` (it drops `.grad`; the job holds its own references) and the next forward.
  A checkpoint's gather, an export and `state` reads call `wait()` first.
- The hyperparameters (the schedule's learning rate) are read at `step()`: the loop may set the next step's before
  the thread reaches a unit.
- The step thread waits only for the disk (its own loads, and the save of the buffer it is about to reuse), never for
  the thread that queued it: no interleaving can deadlock. Under TIGHTFIT_STRICT_MOVER=1 each unit starts after a
  random pause, so the CPU suite sees a forward arrive before the step it needs, as a GPU's would.
- The same kernel as `torch.optim.AdamW(fused=True)` (`_fused_adamw_`, step counts advanced first) on the local
  shards, one parameter group at a time: a shard's update is the one torch's optimizer makes of it.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tightfit.offload.placement import Tier
from tightfit.offload.runtime.movers import strict_from_env, strict_seed
from tightfit.offload.runtime.workers import Worker, thread_budget

MOMENTS = ("exp_avg", "exp_avg_sq")
STRICT_DELAY_S = 0.01
"""Strict mode: the most the step thread waits before each unit's step (TIGHTFIT_STRICT_MOVER)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(name, module, its trainable parameters) of each module `fully_shard` made a unit, in the order a forward
    gathers them (the root's first: its pre-forward gathers its own parameters before any block's). A parameter
    belongs to the innermost unit around it, as FSDP2 groups it."""
    from torch.distributed.fsdp import FSDPModule

    found = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        return [("root", model, [p for p in model.parameters() if p.requires_grad])]
    claimed: set[int] = set()
    params: dict[str, list[nn.Parameter]] = {}
    for name, m in reversed(found):  # innermost first
        mine = [p for p in m.parameters() if p.requires_grad and id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        params[name] = mine
    return [(name, m, params[name]) for name, m in found]


def _step_threads() -> int:
    """The step thread's intra-op threads: on a GPU machine the host's cores are the optimizer's, shared by the node's
    ranks, less one for the thread launching the GPU's kernels; on a CPU the compute needs them ([Note: thread
    budget] in offload/runtime/workers.py)."""
    import os

    from tightfit.parallel.rank_plan import local_ranks

    return thread_budget(max(1, (os.cpu_count() or 1) // local_ranks()), torch.cuda.is_available())["alone"]


class _Unit:
    """One unit's parameters, its moments' layout in the flat entries `MOMENTS` of its store, its queued step."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.name, self.module, self.params = name, module, params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += _local(p).numel()
        self.numel = n
        self.pending: Future | None = None  # its last queued step
        self.arrived = 0  # its parameters whose gradients are final, in a backward a step was declared for
        self.fresh = True  # moments never written: zeros, nothing to read
        self.store = None  # the tier store of its moments (device or host memory, or the rank's swap files)

    @property
    def resident(self) -> bool:
        """Its shards and moments on the device: stepped by `step()` itself, on the device ([Note: a unit kept on
        the device])."""
        return self.store.tier == Tier.DEVICE

    @property
    def on_disk(self) -> bool:
        return self.store.tier == Tier.NVME

    @property
    def moment_bytes(self) -> int:
        return len(MOMENTS) * 4 * self.numel

    def views(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        local = _local(self.params[i])
        return flat[self.offsets[i]:self.offsets[i] + local.numel()].view(local.shape)


class ShardStatesAdamW:
    """AdamW over `param_groups` (FSDP2's sharded parameters, or plain ones; each group a dict with "params" and any of
    lr, betas, eps, weight_decay), each of `units`' moments in `host` (a MemoryStore of host memory) or `disk` (a
    DiskStore of this rank's swap folder), stepped under the next forward. It answers what the training loop and
    tightfit/parallel/state.py ask of an optimizer: `param_groups`, `step`, `zero_grad`, `state`.

    [Note: the moments' tier, unit by unit] Without `disk` every unit's moments are in host memory. With it, the
    units in forward order keep theirs in host memory while they fit `host_room` bytes (None: none do), and the rest
    on the disk: the first units' steps, which the next forward waits for first, read no disk, and each later unit's
    moments load while the units before it step.

    [Note: a unit kept on the device] The units named in `resident` keep their shards on the device (FSDP2 without
    CPU offload for them: parallel/unit_split.py) and their moments in `device` (a MemoryStore of the device's
    memory); `step()` steps them itself, on the device, in the caller's stream order, before it returns: a GPU runs
    their kernels after the backward's and before the next forward's, and no thread but the loop's issues work on
    the device. They are never stepped during the backward (FSDP2's reduce-scatter stream owns their gradients
    until the backward ends)."""

    def __init__(self, param_groups: list[dict], units: list[tuple[str, nn.Module, list[nn.Parameter]]], host,
                 disk=None, host_room: int | None = None, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, device=None, resident=()) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in param_groups if g["params"]]
        self.stores = [s for s in (device, host, disk) if s is not None]
        self.units = [_Unit(*u) for u in units if u[2]]
        resident = set(resident)
        if resident and device is None:
            raise ValueError("units kept on the device need a device store for their moments")
        self._group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        self._unit_of: dict[int, tuple[_Unit, int]] = {}
        room = None if disk is None else host_room or 0  # None: no limit
        for u in self.units:
            fits = room is None or u.moment_bytes <= room
            u.store = device if u.name in resident else host if fits else disk
            if fits and room is not None and u.name not in resident:
                room -= u.moment_bytes
            u.store.allocate(u.name, {m: (u.numel, torch.float32) for m in MOMENTS}, lock=())
            for i, p in enumerate(u.params):
                self._unit_of[id(p)] = (u, i)
        unstepped = [p for g in self.param_groups for p in g["params"] if id(p) not in self._unit_of]
        if unstepped:
            raise ValueError(f"{len(unstepped)} parameters belong to no unit")
        self._steps: dict[int, torch.Tensor] = {}
        self._jobs: list[Future] = []  # the step thread's jobs since the last `wait`: their units, their last saves
        self._disk_turn = 0  # which of the two buffers the next disk unit loads into (the step thread's alone)
        self._declared: list[tuple] | None = None  # `step_during_backward`'s hyperparameters, until `step()`
        self._grad_hooks: list = []
        # A disk unit's moments read for `state` (a checkpoint's gather, a resume), kept until another unit's are
        # asked for or the next step is queued (`_close_open`), so a unit's parameters read or write it once.
        self._open: tuple[_Unit, dict[str, torch.Tensor]] | None = None
        self._open_dirty = False
        largest = max((u.numel for u in self.units if u.on_disk), default=0)
        # Two units' moments at a time on the disk's side: one stepping, the next loading.
        self._slots = [{m: torch.zeros(largest, dtype=torch.float32) for m in MOMENTS} for _ in range(2)] \
            if largest else []
        self._slot_saves: list[list[Future]] = [[], []]
        strict = strict_from_env()
        self._late = random.Random(strict_seed()) if strict else None
        self._worker = Worker("tightfit-shard-steps", threads=_step_threads())
        self._timers = {"optimizer_s": 0.0, "optimizer_exposed_s": 0.0, "nvme_read_bytes": 0, "nvme_write_bytes": 0,
                        "units_stepped_in_backward": 0}
        self._lock = threading.Lock()
        self._hooks = [u.module.register_forward_pre_hook(self._before_forward(u), prepend=True) for u in self.units]
        self.state = _TieredState(self)

    # ---- the loop's calls ----------------------------------------------------------------------------------------

    def _hyper(self) -> list[tuple]:
        return [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in self.param_groups]

    def step_during_backward(self) -> None:
        """The coming backward is the step's last and nothing needs every gradient before a unit steps (no clip, no
        loss scale): each unit is queued as soon as its parameters' gradients are all there ([Note: a unit stepped
        during the backward]); `step()` queues the others."""
        self._declared = self._hyper()
        for u in self.units:
            u.arrived = 0
            for p in (u.params if not u.resident else ()):  # [Note: a unit kept on the device]
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad(u)))

    @torch.no_grad()
    def step(self, closure=None):
        """Queue every unit with gradients not queued during the backward, in forward order; returns at once ([Note:
        steps under the next forward, on FSDP2's shards])."""
        if closure is not None:
            raise ValueError("ShardStatesAdamW takes no closure")
        hyper = self._declared if self._declared is not None else self._hyper()
        early = self._declared is not None
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks, self._declared = [], None
        work, here = [], []
        for u in self.units:
            if early and u.arrived >= len(u.params) and not u.resident:
                continue  # queued as its gradients arrived
            grads = [None if p.grad is None else _local(p.grad) for p in u.params]
            if any(g is not None for g in grads):
                (here if u.resident else work).append((u, grads))
        if work:
            self._submit(work, hyper)
        if here:  # [Note: a unit kept on the device]
            t0 = time.perf_counter()
            for u, grads in here:
                self._step_unit(u, grads, {m: u.store.tensor(u.name, m) for m in MOMENTS}, hyper)
                u.fresh = False
            spent = time.perf_counter() - t0
            with self._lock:
                self._timers["optimizer_s"] += spent
                self._timers["optimizer_exposed_s"] += spent
        return None

    def _submit(self, work: list, hyper: list[tuple]) -> None:
        self._close_open()  # a resume's moments on the disk before the step reads them
        futures = {u.name: Future() for u, _ in work}
        for u, _ in work:
            u.pending = futures[u.name]
        self._jobs.append(self._worker.submit(self._run, work, hyper, futures))

    def _on_grad(self, u: _Unit):
        """[Note: a unit stepped during the backward] A parameter's hook after its gradient is final for the step:
        autograd's for a plain module, FSDP2's after the reduce-scatter of a sharded one (torch 2.13 and later call
        a sharded parameter's post-accumulate-grad hooks there; before, none fires and `step()` queues every unit,
        under the next forward). The unit is queued once every parameter of it has been called, with the
        hyperparameters `step_during_backward` read."""
        def arrived(param) -> None:
            u.arrived += 1
            if u.arrived == len(u.params) and self._declared is not None:
                self._submit([(u, [_local(p.grad) if p.grad is not None else None for p in u.params])],
                             self._declared)
                with self._lock:
                    self._timers["units_stepped_in_backward"] += 1
        return arrived

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (a queued step holds its own references to those it reads)."""
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def wait(self) -> None:
        """Every queued step done and its moments written (its errors raised here: a save that failed is not left
        to be read back stale)."""
        for u in self.units:
            if u.pending is not None:
                u.pending.result()
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._timers)

    def close(self) -> None:
        try:
            self.wait()
            self._close_open()
        finally:
            for h in self._hooks:
                h.remove()
            self._worker.shutdown()
            for store in self.stores:
                store.close()

    # ---- checkpoints: the moments as the one-process format names them -------------------------------------------

    def moments_of(self, u: _Unit) -> dict[str, torch.Tensor]:
        """`u`'s flat moments to read or write outside a step (the caller has waited for the steps): its host
        tensors themselves (zeroed at allocation, as before a first step), or for a disk unit buffers read once
        (zeros before its first step) and kept open; `mark_written` after writing them."""
        if not u.on_disk:  # device or host memory
            return {m: u.store.tensor(u.name, m) for m in MOMENTS}
        if self._open is not None and self._open[0] is u:
            return self._open[1]
        self._close_open()
        flat = {m: torch.zeros(u.numel, dtype=torch.float32) for m in MOMENTS}
        if not u.fresh:
            for f in [u.store.load(u.name, m, flat[m]) for m in MOMENTS]:
                f.result()
        self._open = (u, flat)
        return flat

    def mark_written(self, u: _Unit) -> None:
        """`moments_of(u)` was written (a checkpoint's values): a disk unit's go back before the next step."""
        self._open_dirty = self._open_dirty or u.on_disk

    def _close_open(self) -> None:
        """The open disk unit's moments written back if they changed, and let go."""
        if self._open is not None and self._open_dirty:
            u, flat = self._open
            for f in [u.store.save(u.name, m, flat[m]) for m in MOMENTS]:
                f.result()
            u.fresh = False
        self._open, self._open_dirty = None, False

    # ---- the step thread ----------------------------------------------------------------------------------------

    def _before_forward(self, u: _Unit):
        def wait_for_step(module, args):
            fut = u.pending
            if fut is None:
                return None
            if not fut.done():
                t0 = time.perf_counter()
                fut.exception()  # waits; the error is raised below
                with self._lock:
                    self._timers["optimizer_exposed_s"] += time.perf_counter() - t0
            fut.result()
            return None
        return wait_for_step

    def _run(self, work, hyper, futures: dict[str, Future]) -> None:
        """Step `work`'s units in order, the next disk unit's moments loading while one steps (the disk units take
        the two buffers in turn, across jobs). Every unit's future is completed, with the error where one occurs (a
        forward waiting for it raises instead of waiting forever)."""
        try:
            on_disk = [k for k, (u, _) in enumerate(work) if u.on_disk]
            slot_of = {k: (self._disk_turn + n) % 2 for n, k in enumerate(on_disk)}
            self._disk_turn += len(on_disk)
            following = dict(zip(on_disk, on_disk[1:]))  # each disk unit -> the disk unit after it
            loads = {on_disk[0]: self._load(work[on_disk[0]][0], slot_of[on_disk[0]])} if on_disk else {}
            for k, (u, grads) in enumerate(work):
                if k in following:
                    nxt = following[k]
                    loads[nxt] = self._load(work[nxt][0], slot_of[nxt])
                if self._late is not None:
                    time.sleep(self._late.uniform(0.0, STRICT_DELAY_S))
                t0 = time.perf_counter()
                if u.on_disk:
                    for f in loads.pop(k):
                        f.result()
                    flat = {m: self._slots[slot_of[k]][m][:u.numel] for m in MOMENTS}
                else:
                    flat = {m: u.store.tensor(u.name, m) for m in MOMENTS}
                self._step_unit(u, grads, flat, hyper)
                if u.on_disk:
                    self._slot_saves[slot_of[k]] = [u.store.save(u.name, m, flat[m]) for m in MOMENTS]
                    with self._lock:
                        self._timers["nvme_write_bytes"] += u.moment_bytes
                u.fresh = False
                with self._lock:
                    self._timers["optimizer_s"] += time.perf_counter() - t0
                futures[u.name].set_result(None)
            for saves in self._slot_saves:  # the last units' moments on the disk before anyone reads them
                for f in saves:
                    f.result()
        except BaseException as e:  # noqa: BLE001 - every waiting forward hears of it
            for fut in futures.values():
                if not fut.done():
                    fut.set_exception(e)
            raise

    def _load(self, u: _Unit, slot: int) -> list[Future]:
        """Start reading `u`'s moments into buffer `slot`, once that buffer's last save is done (zeros for moments
        never written). A save that failed fails every later step here: the disk holds stale moments."""
        for f in self._slot_saves[slot]:
            f.result()
        self._slot_saves[slot] = []
        buf = self._slots[slot]
        if u.fresh:
            for m in MOMENTS:
                buf[m][:u.numel].zero_()
            return []
        with self._lock:
            self._timers["nvme_read_bytes"] += u.moment_bytes
        return [u.store.load(u.name, m, buf[m][:u.numel]) for m in MOMENTS]

    def _step_unit(self, u: _Unit, grads: list[torch.Tensor | None], flat: dict[str, torch.Tensor],
                   hyper: list[tuple]) -> None:
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(grads):
            if g is not None and g.numel():
                by_group.setdefault(self._group_of[id(u.params[i])], []).append(i)
        for k, idx in by_group.items():
            lr, beta1, beta2, eps, wd = hyper[k]
            params = [_local(u.params[i]) for i in idx]
            steps = [self._step_count(u.params[i], params[j].device) for j, i in enumerate(idx)]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, [grads[i] for i in idx], [u.views(flat["exp_avg"], i) for i in idx],
                                [u.views(flat["exp_avg_sq"], i) for i in idx], [], steps, amsgrad=False, lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, maximize=False)

    def _step_count(self, p: nn.Parameter, device: torch.device) -> torch.Tensor:
        t = self._steps.get(id(p))
        if t is None:
            t = self._steps[id(p)] = torch.zeros((), dtype=torch.float32, device=device)
        return t


class _TieredState:
    """`optimizer.state` as tightfit/parallel/state.py reads and writes it: `get(p)` -> {exp_avg, exp_avg_sq, step},
    the moments as DTensors sharded like the parameter (or plain tensors), and `state[p] = {...}`, through their
    tier (`moments_of`: a disk unit read once for all its parameters)."""

    def __init__(self, opt: ShardStatesAdamW) -> None:
        self.opt = opt

    def get(self, p, default=None):
        self.opt.wait()
        hit = self.opt._unit_of.get(id(p))
        if hit is None or id(p) not in self.opt._steps:
            return default
        u, i = hit
        flat = self.opt.moments_of(u)
        out = {"step": self.opt._steps[id(p)].clone()}
        for m in MOMENTS:
            v = u.views(flat[m], i).clone()
            if isinstance(p, DTensor):
                v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            out[m] = v
        return out

    def __setitem__(self, p, value: dict) -> None:
        self.opt.wait()
        u, i = self.opt._unit_of[id(p)]
        flat = self.opt.moments_of(u)
        for m in MOMENTS:
            u.views(flat[m], i).copy_(_local(value[m]).to(flat[m].device, torch.float32))
        self.opt.mark_written(u)
        self.opt._steps[id(p)] = torch.as_tensor(value["step"], dtype=torch.float32).reshape(()).clone().to(
            _local(p).device)
