"""Which committed checkpoints a run keeps: judged by its health, pruned by one policy for every trainer.

Why its own object: the one-process trainer and rank 0 of a distributed run commit checkpoints at different moments
(a background writer, a gathered state), but must judge and keep them alike: a checkpoint's verdict is written once
the next step's loss is known (health.py, [Note: verdict]), retention then keeps the newest `--keep-checkpoints` and
the newest healthy one (checkpoint_writer.prune), and a run resumed from an older checkpoint (`--resume-step`)
replaces the later ones with its first commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tightfit.train.checkpoint_writer import drop_newer, prune
from tightfit.train.health import RunHealth, set_verdict


class Retention:
    """The checkpoints this run committed and their verdicts. `root`: the checkpoints folder; `keep`:
    --keep-checkpoints; `resumed_step`: the step the run continued from (0: a fresh run); `say`: the log."""

    def __init__(self, root: Path, keep: int, health: RunHealth, resumed_step: int,
                 say: Callable[[str], None]) -> None:
        self.root, self.keep, self.health, self.resumed_step, self.say = root, keep, health, resumed_step, say
        self.awaiting: dict[int, Path] = {}  # committed, their verdict waiting for the next step's loss
        self.committed_any = False

    def committed(self, step: int, path: Path) -> None:
        """A checkpoint of `step` was committed at `path`."""
        if not self.committed_any:  # resumed from an older checkpoint: this commit replaces the later ones
            newer = drop_newer(self.root, self.resumed_step, step)
            if newer:
                self.say(f"removed the checkpoints of step {', '.join(map(str, newer))}: this run, resumed from "
                         f"step {self.resumed_step}, replaces them")
        self.committed_any = True
        self.awaiting[step] = path
        self.judge(changed=True)

    def judge(self, changed: bool = False, final: bool = False) -> None:
        """Write the verdicts the steps seen so far decide, then prune what retention no longer keeps. `final`: no
        step follows; a checkpoint still waiting is judged by its own step's loss."""
        for s in sorted(self.awaiting):
            verdict = self.health.verdict(s, final=final)
            if verdict is not None:
                set_verdict(self.awaiting.pop(s), *verdict)
                changed = True
        if changed and self.keep:
            prune(self.root, self.keep)
