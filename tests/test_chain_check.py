"""The planner's chain check (planner/chain.py) on autograd graphs whose nodes' Python objects come and go.

Before torch 2.12 an autograd node's Python object lived only while Python held it: a walk that let go of each node
it had visited could meet a later node at a dead one's address, so a check keyed by `id(node)` saw two segments
meet where they did not. On the H200's torch 2.11 that refused unit-major order for a Llama-2-7B ("a tensor made
before model.layers.30's input is used by model.layers.31"), which torch 2.13 here accepts. These graphs make
their Python objects the way torch 2.11 did, so the suite on any torch sees that check."""

from __future__ import annotations

import sys

import torch

from tightfit.planner.chain import ChainCheck


class _Node:
    """The C++ side of an autograd node: its edges."""

    def __init__(self, edges=()):
        self.edges = list(edges)


class _PyNode:
    """A node's Python object. `next_functions` hands out objects from `_POOL` the way torch < 2.12 and CPython's
    allocator did: the live object of that node if Python holds one, else an object nobody holds any more, now
    standing for this node (a dead object's address taken by a new one)."""

    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node

    @property
    def next_functions(self):
        return tuple((_py(n), nr) for n, nr in self.node.edges)


_POOL: list[_PyNode] = []


def _py(node: _Node) -> _PyNode:
    free = None
    for obj in _POOL:
        held = sys.getrefcount(obj) > 3  # beyond the pool, this loop's name and getrefcount's argument
        if held and obj.node is node:
            return obj
        if not held and free is None:
            free = obj
    if free is None:
        free = _PyNode(None)
        _POOL.append(free)
    free.node = node
    return free


def _run(length: int, units: int) -> tuple[list, _Node]:
    """A chain: `units` unit inputs, `length` ops between each pair and after the last; returns each unit's input
    node and the loss's node."""
    node, inputs = _Node(), []
    for u in range(units + 1):
        if u:
            inputs.append(node)
        for _ in range(length):
            node = _Node([(node, 0)])
    return inputs, node


def _check(inputs, loss_node) -> str:
    chain = ChainCheck()
    held = [_py(n) for n in inputs]  # the trace's pre-hooks hold what entered each unit
    chain.entries = [(f"layers.{i}", [(p, 0)]) for i, p in enumerate(held)]
    loss = type("Loss", (), {"grad_fn": _py(loss_node)})()
    return chain.verdict(loss)


def test_a_chain_whose_node_objects_die_between_visits_is_a_chain():
    inputs, loss = _run(length=40, units=6)
    assert _check(inputs, loss) == ""


def test_a_real_join_is_still_found_when_node_objects_die():
    inputs, loss = _run(length=40, units=6)
    loss.edges.append((inputs[2], 0))  # the code after the last unit reads what entered layers.2
    assert "layers.2" in _check(inputs, loss)


def test_a_torch_graph_that_forms_a_chain():
    x = torch.randn(4, requires_grad=True)
    h = x * 2
    a = h.sin()
    b = a.cos() * 3
    chain = ChainCheck()
    chain.enter("a", (h,), {})
    chain.enter("b", (a,), {})
    assert chain.verdict(b.sum()) == ""
    h2 = x * 2
    a2 = h2.sin()
    chain = ChainCheck()
    chain.enter("a", (h2,), {})
    chain.enter("b", (a2,), {})
    assert "a" in chain.verdict((a2.cos() + h2).sum())  # the code after b reads a's input
