"""The one scheduler: the recorded order of units, turned into the moves to issue next under budgets and a look-ahead.

Why recorded rather than derived from the module tree: models call their blocks in any order (encoder-decoder,
shared blocks, early exits), and backward runs them in an order only autograd knows. The first forward and the
first backward are watched; afterwards the scheduler knows, at each unit, which units come next. If a step deviates
(dynamic control flow), the cursor re-synchronises on the unit that actually ran, so a wrong guess costs a wasted
move, never a wrong result: materialisation always waits for the unit it needs.

[Note: moves] What moves ahead of need is decided here and nowhere else (as DeepSpeed's parameter coordinator does
with its trace and look-ahead), in one queue per event, in the recorded order:
- FETCH u: the params of one of the next `depth` units of the running phase (forward or backward), to the device;
  under the device budget (the device meter).
- PRELOAD u: when a step follows this backward, the master and moments of the unit whose backward starts (they
  load under its own backward compute, and its step comes right after it; loading further ahead only held more
  memory longer: +0.2 GB on GPT-2-small all-NVMe, benchmarks/RESULTS.md batch Q); and during the optimizer step
  after backward, of the next `depth` units to step. Under the pool's speculative bound ([Note: speculative
  holdings], host_memory.py).
The engine issues a queue front to back (`issue`); a move its budget refuses stops the moves of its kind behind it
for this event (they come again at the next event, when a unit or its gradients have released memory): moves are
never issued out of order, so room freed is taken by the unit needed first. The one retention rule: a unit whose
forward ends stays materialised when it is among the first `depth` units of the coming backward (DeepSpeed's reuse
distance), as a fetch already issued for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable


class StepPhase(str, Enum):
    """Where the whole model is in its step."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class MoveKind(str, Enum):
    FETCH = "fetch"
    PRELOAD = "preload"


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    unit: str


def distinct(names: list[str], exclude: str | None = None) -> list[str]:
    out: list[str] = []
    for n in names:
        if n != exclude and n not in out:
            out.append(n)
    return out


class Scheduler:
    """Recorded unit sequences per phase, a cursor into the running one, and the moves each event calls for."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.order: dict[StepPhase, list[str]] = {StepPhase.FORWARD: [], StepPhase.BACKWARD: []}
        self.recorded: dict[StepPhase, bool] = {StepPhase.FORWARD: False, StepPhase.BACKWARD: False}
        self._cursor = -1

    # ---- the recorded order ----------------------------------------------------------------------------------------

    def begin(self, phase: StepPhase) -> None:
        self._cursor = -1

    def end(self, phase: StepPhase) -> None:
        if self.order[phase]:
            self.recorded[phase] = True

    def first(self, phase: StepPhase) -> list[str]:
        """The first `depth` units of a phase (known once it was recorded)."""
        return distinct(self.order[phase][: self.depth]) if self.recorded[phase] else []

    def visit(self, phase: StepPhase, unit: str) -> list[str]:
        """Note that `unit` runs now; return the next `depth` units after it (none while recording). Calls of one unit
        in a row are one visit: a unit-major pass runs each unit's micro-batches back to back (step/unit_major.py)."""
        seq = self.order[phase]
        if not self.recorded[phase]:
            if not seq or seq[-1] != unit or self._cursor < 0:
                seq.append(unit)
            self._cursor = len(seq) - 1
            return []
        if 0 <= self._cursor < len(seq) and seq[self._cursor] == unit:
            return distinct(seq[self._cursor + 1 : self._cursor + 1 + self.depth], exclude=unit)
        nxt = self._cursor + 1
        if nxt < len(seq) and seq[nxt] == unit:
            self._cursor = nxt
        elif unit in seq[nxt:]:
            self._cursor = seq.index(unit, nxt)
        elif unit in seq:
            self._cursor = seq.index(unit)
        else:
            return []
        return distinct(seq[self._cursor + 1 : self._cursor + 1 + self.depth], exclude=unit)

    def step_order(self, all_units: list[str]) -> list[str]:
        """The order units are stepped in: backward order (their gradients are ready first), then any unit backward
        did not reach, last first."""
        names = distinct(self.order[StepPhase.BACKWARD])
        return names + [n for n in reversed(all_units) if n not in names]

    def keep_after_forward(self, unit: str) -> bool:
        """Does `unit` stay materialised when its forward ends? ([Note: moves], the reuse distance)"""
        return unit in self.first(StepPhase.BACKWARD)

    # ---- moves ---------------------------------------------------------------------------------------------------

    def moves(self, phase: StepPhase, unit: str | None, step_follows: bool) -> list[Move]:
        """The moves for an event of `phase`: `unit` starts (None: the phase starts), in the order to issue them."""
        if phase == StepPhase.IDLE:
            return []
        ahead = self.visit(phase, unit) if unit is not None else self.first(phase)
        out = [Move(MoveKind.FETCH, u) for u in ahead]
        if phase == StepPhase.BACKWARD and step_follows and unit is not None:
            out.append(Move(MoveKind.PRELOAD, unit))  # loads under the unit's own backward, which its step follows
        return out

    def preloads_ahead(self, order: list[str], index: int) -> list[Move]:
        """During an optimizer step over `order`, at `order[index]`: that unit's preload and the next `depth`."""
        return [Move(MoveKind.PRELOAD, u) for u in order[index : index + 1 + self.depth]]

    @staticmethod
    def issue(moves: list[Move], run: dict[MoveKind, Callable[[str], bool]]) -> None:
        """Issue `moves` front to back; `run[kind](unit)` issues one and says whether its budget admitted it. The
        first refusal of a kind stops that kind for this event ([Note: moves])."""
        stopped: set[MoveKind] = set()
        for move in moves:
            if move.kind not in stopped and not run[move.kind](move.unit):
                stopped.add(move.kind)
