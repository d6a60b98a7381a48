"""The run's checkpoints as the training loop takes them: one save in flight, committed, judged, kept.

Why its own object: a save spans steps. In one process the writer thread commits it while training goes on
(checkpoint_writer.py), and the loop only learns of the commit, or of a non-finite tensor that stopped it (the
run's divergence), later; over a process group the state is gathered to the main rank (a collective every rank
joins), written there, and every rank must learn at once whether the write failed, or the others would wait for
the main rank at their next collective. `Saver` is the one place that knows which: `World.size`.

Invariant: every rank calls `save` and `settle` at the same steps (the loop's deterministic points), so a group's
gathers and votes meet; only `poll`, which commits a save found finished, is rank-local, and only in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tightfit.errors import UsageError
from tightfit.train import checkpoint as ckpt
from tightfit.train.divergence import describe_key


class Saver:
    """Takes the checkpoints of `trainee` into `root` (`<out-dir>/checkpoints`). `keep`: --keep-checkpoints (0: none
    are taken); `fields()`: the run's config, data position and loss scaler for the index, asked at each save;
    `divergence(step, what)`: the error a non-finite saved tensor becomes."""

    def __init__(self, root: Path, keep: int, trainee, world, retention, health, fields: Callable[[], dict],
                 divergence: Callable[[int, str], UsageError]) -> None:
        self.root, self.keep, self.trainee, self.world = root, keep, trainee, world
        self.retention, self.health, self.fields, self.divergence = retention, health, fields, divergence
        self.pending = None  # the save being written (a CheckpointWriter), main rank only
        self.last_good: tuple[int, Path] | None = None  # (step, folder) of the newest committed checkpoint

    def save(self, step: int, last: bool = False) -> None:
        """Start the checkpoint of `step`. `last`: the run's last save, which takes the swap files over; the trainee
        is closed once it has ([Note: the last save takes the swap's place] in memory_model.py)."""
        if not self.keep:
            return
        self.settle()  # one save at a time: its memory and disk are what the plan counted
        with self.world.collective(f"the checkpoint gather at step {step}"):
            groups = self.trainee.checkpoint_groups(hand_over=last)  # collective over a group; None off the main rank
        failed = None
        if groups is not None:
            try:
                self.pending = ckpt.start_save(self.root, groups, step=step, health=self.health.record(step),
                                               signature=ckpt.model_signature(self.trainee.signature_shapes()),
                                               **self.fields())
            except UsageError as e:
                failed = e
            finally:  # a gather stopped early still takes what the other ranks send (parallel/sharded_optimizer.py)
                close = getattr(groups, "close", None)
                if close is not None:
                    close()
        if last:
            self.trainee.close()
        if self.world.size > 1:  # every rank learns now whether the main rank's write failed
            self._settle_together(step, failed)
        elif failed is not None:
            raise failed

    def poll(self) -> None:
        """Commit the save in flight if its writer is done (one process: the writer runs beside the steps)."""
        if self.world.size == 1 and self.pending is not None and self.pending.done():
            self.settle()

    def settle(self) -> None:
        """Wait for the save in flight; a non-finite tensor in it is the run's divergence."""
        if self.pending is None:
            return
        writer, self.pending = self.pending, None
        path = writer.wait()
        if path is None:
            nf = writer.non_finite
            self.retention.judge()
            raise self.divergence(writer.step, f"{describe_key(nf.key)} became {nf.what}")
        self.last_good = (writer.step, path)
        self.retention.committed(writer.step, path)

    def _settle_together(self, step: int, failed: UsageError | None) -> None:
        """The vote after the main rank's write is the barrier: no rank goes on before it is done, and all stop if
        it failed (the main rank raises what failed; the others stop quietly, naming the step)."""
        if self.pending is not None:
            try:
                self.settle()
            except UsageError as e:
                failed = e
        if not self.world.any_rank(failed is not None, f"the barrier after rank 0 wrote the checkpoint of step "
                                                       f"{step}"):
            return
        if failed is not None:
            raise failed
        raise self.world.raised_everywhere(UsageError(f"rank {self.world.rank}: stopping: rank 0 could not save "
                                                      f"the checkpoint of step {step}"))

    def abort(self) -> None:
        """Drop the save in flight (the run is failing with another error)."""
        if self.pending is not None:
            self.pending.abort()
            self.pending = None
