"""Do a model's units form a chain? The condition unit-major accumulation needs, checked on the planner's meta trace.

Unit-major accumulation (offload/step/unit_major.py) cuts each micro-batch's graph at every unit's input and runs
backward one segment at a time ([Note: a chain of units] there). That is exact when the segments' graphs are apart:
every non-leaf tensor that needs a gradient and enters a unit was made since the previous unit's input. The planner's
trace runs one forward of the model on the meta device (model_profile.py); this records what enters each unit and
walks the graph backwards from the loss, segment by segment, each walk stopping at the tensors that entered the unit
opening its segment. A node reached from two segments, a tensor entering two units, or a walk that reaches the
tensors of an earlier unit than its own is a join: the answer is then why not, in one line, which the plan prints.

The model's tail (the code after its last unit: a language model's final norm, head and loss) is cut too, at the
first module outside the units holding parameters of its own that runs after a unit ([Note: the tail per
micro-batch] in offload/step/unit_major.py): `enter_tail` records it as one more entry, so its segment is checked
apart from the last unit's like any other, and a unit entered after it means the model has no tail to cut.

The walk follows autograd's edges `(node, output index)`: a tensor that entered a unit stops a walk only through
the output it is, so an op whose one output entered a unit and another went on beside it is seen as the join it is.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


class ChainCheck:
    """Records the tensors that enter each unit during one forward (`enter`, from the units' pre-hooks), then says
    whether the units form a chain (`verdict`)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, list[tuple[object, int]]]] = []  # (unit, its inputs' (grad_fn, output index))
        self._seen: dict[tuple[object, int], str] = {}  # an input's edge -> the unit it entered
        self.problem = ""
        self.tail = ""  # the module that starts the model's tail, once entered

    def enter_tail(self, path: str, args, kwargs) -> bool:
        """Module `path` of the root, which holds parameters of its own, runs: after a unit and for the first time
        since, it starts the model's tail, recorded as an entry (True); else nothing (False)."""
        if not self.entries or self.tail:
            return False
        self.tail = path
        self.enter(f"the model's tail ({path})", args, kwargs)
        return True

    def enter(self, unit: str, args, kwargs) -> None:
        """Record what enters `unit`: by autograd edge, not by tensor (holding the tensors would keep activations
        alive that the trace measures the life of)."""
        if self.tail and not unit.startswith("the model's tail") and not self.problem:
            self.problem = (f"{self.tail} (a module of the root with parameters of its own) runs between two units, "
                            f"before {unit}, so the model's tail cannot be cut")
        edges = []
        for t in tree_leaves((args, kwargs)):
            if not (isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None):
                continue
            edge = (t.grad_fn, t.output_nr)
            if edge in self._seen and not self.problem:
                self.problem = f"one tensor enters both {self._seen[edge]} and {unit}"
            self._seen[edge] = unit
            edges.append(edge)
        self.entries.append((unit, edges))

    def verdict(self, loss: torch.Tensor) -> str:
        """"" when the units form a chain, else why not. Call after forward, before backward (it walks the graph);
        it lets go of what it recorded, so the tensors it held die when backward frees them (the trace measures when
        activations are freed)."""
        try:
            return self._verdict(loss)
        finally:
            self.entries, self._seen, self.tail = [], {}, ""

    def _verdict(self, loss: torch.Tensor) -> str:
        if self.problem:
            return self.problem
        if not self.entries:
            return "the model has no units besides its root"
        # node -> the segment that reached it. Keyed by the node object, not id(node): holding each node keeps its
        # Python object alive, so a later access returns that object; before torch 2.12 an object nobody held died
        # and a new node's could take its address (its id), two segments then seeming to meet.
        owner: dict[object, int] = {}
        stops = [set(edges) for _, edges in self.entries]
        starts = [[loss.grad_fn] if loss.grad_fn is not None else []]
        for s in range(len(self.entries) - 1, -1, -1):
            starts.append([node for node, _ in self.entries[s][1]])
        for k, roots in enumerate(starts):
            s = len(self.entries) - k  # segment s runs from entry s-1 (its stops) to entry s (or the loss)
            mine = stops[s - 1] if s > 0 else set()
            earlier = set().union(*stops[: max(0, s - 1)]) if s > 1 else set()
            todo = [n for n in roots if n is not None]
            while todo:
                node = todo.pop()
                if node in owner:
                    if owner[node] != s:
                        return self._join(s, owner[node])
                    continue
                owner[node] = s
                for nxt, nr in node.next_functions:
                    if nxt is None or (nxt, nr) in mine:
                        continue
                    if (nxt, nr) in earlier:
                        return self._join(s, next(i for i in range(s - 1) if (nxt, nr) in stops[i]) + 1)
                    if type(nxt).__name__ != "AccumulateGrad":
                        todo.append(nxt)
        return ""

    def _join(self, a: int, b: int) -> str:
        """Why segments `a` and `b` are not apart: their walks met (the later one uses a tensor made before the
        earlier one's start)."""
        early, late = sorted((a, b))
        used = f"{self.entries[late - 1][0]} and the code after it"
        if early == 0:
            return f"a tensor made before the first unit is used by {used}"
        return f"a tensor made before {self.entries[early - 1][0]}'s input is used by {used}"
