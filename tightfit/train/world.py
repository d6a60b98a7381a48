"""The processes one run trains in, as the training loop sees them: one process is a world of size one.

Why its own object: `tightfit train` has one loop (loop.py) for every world size. What a group of processes adds
to it is two things, and only these: how the model becomes something to train (one process: `setup_memory`'s
plain or offloaded model; several: the parallel transform of tightfit/parallel, applied before the loop, as
torchtitan applies its parallelisms before its train loop), and the decisions every rank must take together
(stop now, a save failed, a run refused), which a group takes by a vote. A `World` of size one takes each decision
alone; `tightfit.parallel.world.GroupWorld` is the same object over a process group.

Invariant: the loop calls every voting method at the same points on every rank (never behind a rank-local
condition), so a group's votes always meet.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from tightfit.errors import UsageError


class World:
    """One process. `rank` 0 of `size` 1: it prints, writes the checkpoints and the metrics."""

    rank = 0
    size = 1

    @property
    def is_main(self) -> bool:
        """The rank that prints, writes metrics and commits checkpoints."""
        return self.rank == 0

    @contextmanager
    def collective(self, what: str):
        """Label the collective calls made inside the block (a group names it when a peer is lost)."""
        yield

    def max_over_ranks(self, values: list[int], what: str) -> list[int]:
        """The largest of every rank's value at each position, the same on every rank (here: this rank's)."""
        return [int(v) for v in values]

    def any_rank(self, flag: bool, what: str) -> bool:
        """True on every rank if `flag` is true on any: a decision every rank takes together."""
        return bool(self.max_over_ranks([1 if flag else 0], what)[0])

    def barrier(self, what: str) -> None:
        """No rank goes on before every rank has come here."""

    def raised_everywhere(self, error: UsageError) -> UsageError:
        """`error`, which every rank raises alike: only the main rank says it (`quiet` marks the others')."""
        if not self.is_main:
            error.quiet = True
        return error

    def device(self, cfg) -> torch.device:
        """The device this rank computes on (--device)."""
        from tightfit.train.loop import resolve_device

        return resolve_device(cfg)

    def streams_weights(self, cfg) -> bool:
        """Whether the model is built on the meta device and its weights streamed into their tiers after wrapping
        (one unit in host memory at a time: larger than RAM is fine): an offloaded Hugging Face model."""
        from tightfit.train.trainee import streams_weights

        return streams_weights(cfg)

    def trainee(self, model: torch.nn.Module, cfg, device: torch.device, dtype: torch.dtype, resume,
                planned: Callable | None, say: Callable[[str], None]):
        """What the loop trains: the model held as the plan says (`setup_memory`), the resumed checkpoint's state
        or the Hugging Face weights imported into it. `planned(plan)` runs before the engine allocates."""
        from tightfit.train.trainee import one_process

        return one_process(model, cfg, device, dtype, resume, planned, say)

