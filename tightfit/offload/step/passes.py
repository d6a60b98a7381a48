"""A unit-major pass as the engine sees it: how many micro-batches each unit runs back to back, and how far each has got.

Why a record of its own: in a unit-major pass (step/unit_major.py) the hooks fire once per micro-batch, but a unit's
params are fetched once for all of them and its gradients leave once, summed on the device. The engine's per-event
rules ("release at forward end", "ship when the unit's gradients are complete", "end of backward when autograd's graph
task ends") then count to M instead of firing at the first micro-batch. Outside a pass the engine has no record and
every event means what it always did: a pass is the general path with M micro-batches, micro-batch-major order is it
with M = 1 and one graph task per backward.

[Note: the end of a unit's backward in a pass] A unit's backward of one micro-batch is one `torch.autograd.backward`
call of the executor over the unit's segment; when it returns, every gradient of that micro-batch's segment has
accumulated. The executor says so (`micro_batch_done`), and the unit's M-th is the end of its backward: its gradient
sums are final and leave the device. Autograd's own signals cannot tell that: the inputs' gradient hook fires before
a parameter's accumulation may have run, and a unit whose inputs need no gradient (a frozen embedding below it) has
none. The root's segments are the first and the last of a micro-batch: it finishes when the pass ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class UnitMajorPass:
    """One pass of `micro_batches` micro-batches, each unit running all of them before the next unit."""

    micro_batches: int
    forwards: Counter = field(default_factory=Counter)
    """Unit name -> forward calls ended in this pass: the unit is released (or kept) at its M-th."""
    backwards: Counter = field(default_factory=Counter)
    """Unit name -> micro-batches whose backward of the unit completed ([Note: the end of a unit's backward in a
    pass])."""
    roots_open: int = 0
    """Micro-batches whose forward through the model has started and not ended: the forward phase spans them all."""

    def forward_ended(self, name: str) -> bool:
        """A forward call of `name` ended: is it the last of this visit (the M-th)?"""
        self.forwards[name] += 1
        return self.forwards[name] % self.micro_batches == 0

    def backward_done(self, name: str) -> bool:
        """A micro-batch's backward of `name` completed: is it the last (the M-th)?"""
        self.backwards[name] += 1
        return self.backwards[name] % self.micro_batches == 0
