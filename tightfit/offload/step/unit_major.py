"""Unit-major accumulation: a step's M micro-batches run through the model one unit at a time, forward and backward.

Why: in micro-batch-major order (each micro-batch's forward and backward before the next) every micro-batch fetches
every streamed unit's params again and sends every unit's gradients off the device, where the host adds them into
the step's sum: M crossings of the link and M - 1 passes over host memory for one step (the H200's 1.1B Llama at 32k
tokens a step ran at 0.31x plain PyTorch, benchmarks/gpu-runs/2026-11-27c). Unit-major order runs each unit's M
micro-batches back to back: its params are fetched once for all of them, its gradients are summed on the device and
leave once ([Note: gradient sums on the device] in unit.py). GreedySnake calls this order vertical.

How, with the model's own forward code (any model whose units form a chain, [Note: a chain of units]):
- Forward. Each micro-batch's forward runs on a thread of its own, and one runs at a time (`_Baton`). A forward
  pre-hook on each unit's first module stops the thread there and hands the turn back; the executor gives turns
  round-robin in micro-batch order, so every micro-batch reaches unit k, then each runs through unit k in turn: the
  unit computes its M micro-batches back to back, and the order of the device's kernels is the same in every run.
- The cut. The same hook replaces each input of the unit that needs a gradient (a non-leaf tensor) by a tensor of its
  own, detached from the graph that made it, whose gradient backward leaves in a holder (`_Boundary`): each
  micro-batch's graph becomes a chain of segments, segment s from the input of the unit met s-th (segment 0 from
  the model's inputs) to the next unit's input (the last unit's: to the model's tail, below). The cut keeps the holder and the autograd
  edge of the tensor it replaced, not the tensors themselves: a boundary's memory is the device's only while
  something computes with it or saves it ([Note: boundaries on the host] in boundaries.py moves the saved ones).
- The tail. The model's code after its last unit (a language model's final norm, head and loss) is cut from the
  last unit's segment the same way, at the first module outside the units holding parameters of its own that the
  micro-batch calls after a unit (`root_modules`), and runs its backward as soon as its micro-batch's forward has
  returned the loss, before the next micro-batch computes its tail ([Note: the tail per micro-batch]).
- Backward. Segment by segment from the last unit's back, within a segment micro-batch by micro-batch in order:
  `torch.autograd.backward` of the segment's outputs (the edges cut at the next unit) with the gradients the next
  segment left in the holders. Each parameter receives its micro-batches' gradients in micro-batch
  order, as micro-batch-major order adds them: the same sums, bitwise in fp32. (A parameter two segments use, an
  embedding tied to the head, receives its two uses' gradients in another order: equal within rounding.) After a
  unit's segment, the engine is told (`micro_batch_done`); at the M-th its sums leave the device.

[Note: a chain of units] The cut is exact when every non-leaf tensor that needs a gradient and enters a unit was made
since the previous unit's input: then each segment's graph is its own, and backward through one segment touches no
other. A tensor made earlier and passed to a later unit (one input to several units, as the tiles of a tiled layer
share theirs; a skip connection from the embedding to every block) would join two segments' graphs. The hook refuses
a tensor cut twice (`UsageError`); the planner checks the whole condition on the meta device before a run
(`is_chain`) and plans micro-batch-major order for a model that fails it, saying why. Randomness in forward (dropout)
draws from the generators in the order kernels run, which is not micro-batch-major order: the same distribution,
other masks.

[Note: the tail per micro-batch] Everything a micro-batch's forward saves waits for its backward in unit-major
order, M micro-batches at once. Most of it is the units' (and, checkpointed, only their inputs), but a language
model's tail saves its logits and their softmax in fp32: at a 32,000-word vocabulary 0.75 GB a micro-batch of
2 x 2048 tokens, 24 GB for 32 of them, more than everything else a checkpointed 1.1B model saves. So the tail does
not wait: each micro-batch stops at the tail's first module (after every micro-batch has computed the last unit),
then in micro-batch order each computes its tail and loss and runs the tail's backward at once (the caller's
`before_backward` first, once), leaving the gradient of the last unit's outputs in the cut's holders. The device
holds one micro-batch's tail, and M of those gradients (one unit output each). Each root parameter receives its
micro-batches' gradients in micro-batch order, as before: the results do not change. The engine is in its backward
phase from the first tail's backward while the later micro-batches still finish their forwards (engine.py,
`on_root_forward_end`). A model that calls such a module again between two units has no tail to cut: the unit's
hook refuses it in one line, and the planner's trace says so before a run (planner/chain.py). A model whose tail
calls no module of its own (a loss on the last unit's output alone) keeps the tail in the last segment, its backward
with the rest.

Threads: the micro-batch threads live as long as the executor (`close`, also run by the engine's close); each runs
its forward with the grad mode and intra-op thread count of the thread that called `run`. Only one of them runs at
a time, and the caller waits meanwhile, so the engine's hooks see one micro-batch at a time, as they always did.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from tightfit.errors import UsageError
from tightfit.offload.runtime.workers import set_own_threads
from tightfit.offload.step.boundaries import BoundaryStore
from tightfit.offload.step.units import root_modules

_local = threading.local()  # .micro: the _MicroBatch whose forward this thread runs (None elsewhere)

EDGES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 7)
"""Does `torch.autograd.backward` take autograd edges (torch >= 2.7)? Then a cut holds the edge of the tensor it
replaced, not the tensor; before, the tensor (and its memory) until the segment's backward."""


class _Seen:
    """Tensors met so far, by identity, holding none of them: a tensor freed since is not met again when a new one
    takes its address (its `id`)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class _Holder:
    """Where backward leaves a cut input's gradient."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _Boundary(torch.autograd.Function):
    """A unit's input cut from the graph that made it: the same values (the same storage), a node of its own whose
    gradient is kept in `holder` and goes no further. `anchor` (an empty leaf that needs a gradient) makes the output
    need one; no node keeps the tensor, as a leaf's gradient accumulator would."""

    @staticmethod
    def forward(ctx, anchor, x, holder):
        ctx.holder = holder
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        h = ctx.holder
        h.grad = grad if h.grad is None else h.grad + grad
        return None, None, None


class _Aborted(BaseException):
    """Unwinds a micro-batch's forward when another one failed."""


class _Baton:
    """Whose turn it is: the executor's caller (None) or one micro-batch. Exactly one of them runs."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = None

    def hand(self, to, me=None, wait: bool = True) -> None:
        """Give the turn to `to`; then (`wait`) block until it comes back to `me`."""
        with self._cv:
            self._turn = to
            self._cv.notify_all()
            while wait and self._turn is not me:
                self._cv.wait()

    def wait(self, me) -> None:
        with self._cv:
            while self._turn is not me:
                self._cv.wait()


@dataclass
class _Cut:
    """What a unit's pre-hook cut from one micro-batch's graph: the autograd edges of the tensors that entered it
    (the tensors themselves where `torch.autograd.backward` takes no edges), and where the gradients of the inputs
    the unit got instead are left."""

    edges: list
    holders: list[_Holder]


@dataclass
class _MicroBatch:
    """One micro-batch's forward, on a thread of its own that ends with it ([Note: one OpenMP pool per thread])."""

    index: int
    baton: _Baton
    units: list[str] = field(default_factory=list)  # the units whose pre-hook it met, in order
    cuts: list[_Cut | None] = field(default_factory=list)  # one per entry of `units`, then the tail's; freed after
    # their backward
    cut: "_Seen" = field(default_factory=lambda: _Seen())  # the tensors cut so far (refused a second time)
    boundaries: dict = field(default_factory=dict)  # id -> (weakref, cut index) of the inputs of the unit it computes
    loss: torch.Tensor | None = None
    error: BaseException | None = None
    finished: bool = False
    abort: bool = False

    def start(self, fn: Callable[[], torch.Tensor], grad: bool, threads: int, device: torch.device,
              store: BoundaryStore | None) -> None:
        self.thread = threading.Thread(target=self._run, args=(fn, grad, threads, device, store), daemon=True,
                                       name=f"tightfit-micro-batch-{self.index}")
        self.thread.start()

    def _run(self, fn, grad: bool, threads: int, device: torch.device, store: BoundaryStore | None) -> None:
        self.baton.wait(self)
        try:
            if not self.abort:
                _local.micro = self
                set_own_threads(threads)
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                hooks = (torch.autograd.graph.saved_tensors_hooks(self._packer(store), _unpacker(store))
                         if store is not None else contextlib.nullcontext())
                with torch.set_grad_enabled(grad), hooks:
                    self.loss = fn()
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - the executor's caller raises it
            self.error = e
        finally:
            _local.micro = None
            self.finished = True
            self.baton.hand(None, wait=False)

    def arrive(self, unit: str | None) -> None:
        """This thread's forward reached `unit` (None: the model's tail): the turn goes back to the executor until it
        is this one's again."""
        self.boundaries.clear()  # the last unit's inputs are computed: what is saved from now on is not them
        self.baton.hand(None, me=self)
        if self.abort:
            raise _Aborted()
        if unit is not None:
            self.units.append(unit)

    @property
    def has_tail(self) -> bool:
        """Has this forward's tail been cut? Its cut follows the units' in `cuts`."""
        return len(self.cuts) > len(self.units)

    def _packer(self, store: BoundaryStore):
        """The saved-tensor pack hook of this micro-batch's forward: a boundary of the unit it computes goes to the
        host ([Note: boundaries on the host] in boundaries.py); anything else stays as it is."""
        def pack(t: torch.Tensor):
            entry = self.boundaries.get(id(t))
            if entry is None or entry[0]() is not t:
                return t
            return store.pack(t, (entry[1], self.index))

        return pack


def _unpacker(store: BoundaryStore):
    def unpack(saved):
        return saved if isinstance(saved, torch.Tensor) else store.unpack(saved)

    return unpack



class UnitMajor:
    """Runs a wrapped model's micro-batches unit by unit. `run(forwards)` is one step's accumulation: forward and
    backward of every micro-batch; the optimizer step comes after, as always. Built once per model (its hooks stay
    until `close`); harmless to forwards it does not run (evaluation, a micro-batch-major loop)."""

    def __init__(self, model: nn.Module, boundaries_on_host: bool = False) -> None:
        from tightfit.offload.step.engine import engine_of

        self.engine = engine_of(model)
        self._baton = _Baton()
        self._anchor = torch.empty(0, requires_grad=True)
        self.store = None  # [Note: boundaries on the host] in boundaries.py
        if boundaries_on_host:
            if not EDGES:
                raise UsageError("boundary activations on the host need torch >= 2.7 (torch.autograd.backward of "
                                 f"autograd edges); this is torch {torch.__version__}")
            e = self.engine
            self.store = e.boundaries = BoundaryStore(e.mover, e.pool.allocator, e.device)
        self._handles = []
        paths = []
        for unit in self.engine.units.values():
            if not unit.spec.is_root:
                paths += [path for path, _ in unit.spec.members]
                self._handles.append(unit.spec.modules[0].register_forward_pre_hook(
                    self._hook(unit.name), with_kwargs=True, prepend=True))
        for path, module in root_modules(model, paths):
            self._handles.append(module.register_forward_pre_hook(self._tail_hook(path), with_kwargs=True,
                                                                  prepend=True))
        self.engine.on_close.append(self.close)

    def _micro(self) -> "_MicroBatch | None":
        """The micro-batch whose forward this thread runs for this executor, or None."""
        micro = getattr(_local, "micro", None)
        return micro if micro is not None and micro.baton is self._baton else None

    def _hook(self, unit: str):
        def cut(module, args, kwargs):
            micro = self._micro()
            if micro is None:
                return None  # a forward this executor does not run
            if micro.has_tail:
                raise UsageError(f"unit-major accumulation: {unit!r} runs after a module of the model's root that "
                                 "holds parameters was called after another unit, so the model's tail cannot be "
                                 "cut; use --accumulation micro (micro-batch-major order)")
            micro.arrive(unit)
            args, kwargs, done = self._cut(micro, unit, args, kwargs, boundaries=True)
            micro.cuts.append(done)
            return args, kwargs

        return cut

    def _tail_hook(self, path: str):
        def cut(module, args, kwargs):
            micro = self._micro()
            if micro is None or not micro.units or micro.has_tail:
                return None  # not this executor's, before the first unit (an embedding), or within the tail
            micro.arrive(None)
            args, kwargs, done = self._cut(micro, path, args, kwargs, boundaries=False)
            micro.cuts.append(done)
            return args, kwargs

        return cut

    def _cut(self, micro: _MicroBatch, where: str, args, kwargs, boundaries: bool):
        """Replace each input of `where` that has a graph (a non-leaf tensor needing a gradient) by a tensor of its
        own ([Note: a chain of units]); `boundaries`: the unit's saved inputs may wait on the host."""
        edges, holders = [], []
        index = len(micro.cuts)

        def cut_of(t):
            if not (isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf):
                return t  # a parameter or a constant: no graph to cut
            if t in micro.cut:
                raise UsageError(f"unit-major accumulation: a tensor enters {where!r} that already entered another "
                                 "unit of this micro-batch, so the units do not form a chain; use "
                                 "--accumulation micro (micro-batch-major order)")
            micro.cut.add(t)
            holder = _Holder()
            x = _Boundary.apply(self._anchor, t.detach(), holder)
            edges.append(torch.autograd.graph.get_gradient_edge(t) if EDGES else t)
            holders.append(holder)
            if boundaries:
                micro.boundaries[id(x)] = (weakref.ref(x), index)
            return x

        args, kwargs = tree_map(cut_of, (args, kwargs))
        return args, kwargs, _Cut(edges, holders)

    def run(self, forwards: list[Callable[[], torch.Tensor]], backward: Callable = lambda loss: loss,
            before_backward: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch (`forwards[m]()` returns its loss), unit by unit. `backward(loss)`:
        the tensor to differentiate (a scaled loss); `before_backward()` runs once before the first backward (a loop
        declares its step there). Returns the losses, in micro-batch order."""
        micro = [_MicroBatch(m, self._baton) for m in range(len(forwards))]
        declared = []

        def declare() -> None:
            if not declared:
                declared.append(True)
                if before_backward is not None:
                    before_backward()

        self.engine.begin_pass(len(micro))
        try:
            grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
            for mb, fn in zip(micro, forwards):
                mb.start(fn, grad, threads, self.engine.device, self.store)
            self._forward(micro, backward, declare)
            for mb in micro:
                mb.thread.join()  # its OpenMP pool goes with it ([Note: one OpenMP pool per thread])
            declare()
            self._backward(micro, backward)
            return [mb.loss for mb in micro]
        finally:
            for mb in micro:
                mb.cuts, mb.cut, mb.boundaries = [], _Seen(), {}
            if self.store is not None:
                self.store.clear()
            self.engine.end_pass()

    def _forward(self, micro: list[_MicroBatch], backward: Callable, declare: Callable[[], None]) -> None:
        """Round-robin turns until every forward has finished, each micro-batch's tail backward as soon as its
        forward has ([Note: the tail per micro-batch]); a failure stops the others and is raised."""
        live = list(micro)
        while live:
            for mb in live:
                self._baton.hand(mb)
                if mb.error is not None:
                    self._abort(micro)
                    raise mb.error
                if mb.finished and mb.has_tail and mb.loss is not None and mb.loss.requires_grad:
                    try:
                        declare()
                        torch.autograd.backward(backward(mb.loss))
                    except BaseException:
                        self._abort(micro)
                        raise
            live = [mb for mb in live if not mb.finished]
        first = micro[0].units
        for mb in micro[1:]:
            if mb.units != first:
                raise UsageError(f"unit-major accumulation: micro-batch {mb.index} met the units in another order "
                                 f"than micro-batch 0 ({mb.units[:4]}... vs {first[:4]}...); use --accumulation "
                                 "micro (micro-batch-major order)")

    def _abort(self, micro: list[_MicroBatch]) -> None:
        for mb in micro:
            mb.abort = True
        for mb in micro:
            while not mb.finished:
                self._baton.hand(mb)

    def _backward(self, micro: list[_MicroBatch], backward: Callable) -> None:
        """Segment by segment from the last unit's back; in each, micro-batch by micro-batch. The last unit's segment
        starts from the gradients its tail's backward left ([Note: the tail per micro-batch]), or from the loss where
        the tail was not cut. The backward of segment s recomputes (or reads what was saved of) unit s - 1, whose
        input is boundary (s - 1, micro-batch): with boundaries on the host, the next one in this order comes back
        while this one computes."""
        segments = len(micro[0].units)
        order = [(s, mb) for s in range(segments, -1, -1) for mb in micro]
        for k, (s, mb) in enumerate(order):
            if self.store is not None:
                for s2, mb2 in order[k:k + 2]:
                    if s2 > 0:
                        self.store.prefetch((s2 - 1, mb2.index))
            if s == len(mb.cuts):  # the last unit's segment, the tail not cut: from the loss
                if mb.loss.requires_grad:
                    torch.autograd.backward(backward(mb.loss))
            else:
                cut, mb.cuts[s] = mb.cuts[s], None  # its holders' gradients go with it
                pairs = [(e, h.grad) for e, h in zip(cut.edges, cut.holders) if h.grad is not None]
                if pairs:
                    torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
            if s > 0:
                if self.store is not None:
                    self.store.done((s - 1, mb.index))
                self.engine.micro_batch_done(mb.units[s - 1])

    def close(self) -> None:
        """Remove the hooks, give the boundaries' host buffers back. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.store is not None:
            self.store.close()
            if self.engine.boundaries is self.store:
                self.engine.boundaries = None
            self.store = None
