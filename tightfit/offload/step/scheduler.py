"""The execution order of units, recorded on the first step, and which units to prefetch next.

Why recorded rather than derived from the module tree: models call their blocks in any order (encoder-decoder,
shared blocks, early exits), and backward runs them in an order only autograd knows. The first forward and the
first backward are watched; every later step prefetches the next `depth` units of the recorded sequence while
the current one computes. If a step deviates (dynamic control flow), the cursor re-synchronises on the unit that
actually ran, so a wrong guess costs a wasted prefetch, never a wrong result: materialisation always waits for
the unit it needs.
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Schedule:
    """Recorded unit sequences per phase and a cursor into the current one."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.order: dict[Phase, list[str]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self.recorded: dict[Phase, bool] = {Phase.FORWARD: False, Phase.BACKWARD: False}
        self._cursor = -1

    def begin(self, phase: Phase) -> None:
        self._cursor = -1

    def end(self, phase: Phase) -> None:
        if self.order[phase]:
            self.recorded[phase] = True

    def first(self, phase: Phase) -> list[str]:
        """Units to prefetch when a phase starts."""
        return self._distinct(self.order[phase][: self.depth]) if self.recorded[phase] else []

    def visit(self, phase: Phase, unit: str) -> list[str]:
        """Note that `unit` runs now; return the units to prefetch after it."""
        seq = self.order[phase]
        if not self.recorded[phase]:
            seq.append(unit)
            self._cursor = len(seq) - 1
            return []
        nxt = self._cursor + 1
        if nxt < len(seq) and seq[nxt] == unit:
            self._cursor = nxt
        elif unit in seq[nxt:]:
            self._cursor = seq.index(unit, nxt)
        elif unit in seq:
            self._cursor = seq.index(unit)
        else:
            return []
        return self._distinct(seq[self._cursor + 1 : self._cursor + 1 + self.depth], exclude=unit)

    @staticmethod
    def _distinct(names: list[str], exclude: str | None = None) -> list[str]:
        out: list[str] = []
        for n in names:
            if n != exclude and n not in out:
                out.append(n)
        return out
