"""A process group as the training loop's world (tightfit/train/world.py): its votes, its labels, its trainee.

What a group adds to the one loop: the parallel transform (`trainee`: the strategy, then either the offload engine
on every rank, replicas.py, or the mesh, `parallelize`, the optimizer and the resumed state, trainee.py), and the decisions every rank takes together, each one tiny
all-reduce. Every collective call runs inside `collective(what)`, which labels it: when a peer is lost,
`run_distributed` names the phase this rank stopped waiting in (`where()`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

from tightfit.train.world import World

_WHERE = ["setup (process group and device mesh)"]
"""The collective phase this rank is in. Invariant: left as it is when a phase raises, so the failure report
(`run_distributed`) names the phase the rank stopped waiting in."""


def where() -> str:
    """The collective phase this rank is in, or last failed in."""
    return _WHERE[0]


def set_phase(what: str) -> None:
    _WHERE[0] = what


@contextmanager
def collective(what: str):
    """Label the collective calls made inside the block (for the one-line report when a peer is lost)."""
    set_phase(what)
    yield
    set_phase("between collectives")


def max_over_ranks(values: list[int], what: str) -> list[int]:
    """The largest of every rank's value at each position (one tiny all-reduce), the same on every rank."""
    t = torch.tensor([float(v) for v in values])
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        t = t.cuda()
    with collective(what):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


class GroupWorld(World):
    """This rank of an initialised process group (`env`: mesh.DistEnv)."""

    def __init__(self, env) -> None:
        self.env = env
        self.rank, self.size = env.rank, env.world_size

    @contextmanager
    def collective(self, what: str):
        with collective(what):
            yield

    def max_over_ranks(self, values: list[int], what: str) -> list[int]:
        return max_over_ranks(values, what)

    def barrier(self, what: str) -> None:
        with collective(what):
            dist.barrier()

    def device(self, cfg) -> torch.device:
        return self.env.device

    def streams_weights(self, cfg) -> bool:
        return False  # every rank builds the whole model and shards it (parallelize.py)

    def trainee(self, model: torch.nn.Module, cfg, device: torch.device, dtype: torch.dtype, resume,
                planned: Callable | None, say: Callable[[str], None]):
        from tightfit.parallel.replicas import replicate
        from tightfit.parallel.run import resolve_plan
        from tightfit.parallel.trainee import shard

        plan = resolve_plan(cfg, self.size, model, say)
        averaged = None  # the gradients' group and averaging, where choosing ZeRO-3's path measured them
        if plan.engine and plan.dp_mode == "zero3":  # FSDP2's or the exchange ([Note: two ZeRO-3s with the offload])
            from tightfit.parallel.zero3_path import decide

            plan, averaged = decide(model, cfg, self, plan, say)
        if plan.engine:
            return replicate(model, cfg, self, device, dtype, resume, planned, say,
                             sharding=plan.dp_mode if plan.dp_mode != "ddp" else None, averaged=averaged)
        return shard(model, cfg, self, plan, dtype, resume, say)
