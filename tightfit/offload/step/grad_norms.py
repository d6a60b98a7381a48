"""Each parameter's gradient 2-norm: taken by the gradient worker where a step will ask for it, on demand otherwise.

Why: clipping, the loss scaler's overflow check and a logged norm need the norm of each parameter's *accumulated*
gradient, and only after the last micro-batch of a step. The gradient worker has that sum in hand as it adds the
last micro-batch (in cache for a unit bound for disk, before it is written), so taking the norm there costs one read
of host memory and no second pass over the disk. Taken after every micro-batch, as the engine used to, it is a read
of 4 bytes a parameter per micro-batch that only the last one needs; taken in a step that never asks (no clipping,
no scaler; a step during backward, which consumes the gradients as they land) it is all waste. On a GPU machine
these reads compete with the CPU optimizer for the host's memory ([Note: host passes], planner/costs.py).

[Note: norms when asked] The worker takes the norms of a backward's sums when the step that follows is known to ask:
- a declared backward (the optimizer said a step follows it: the loop's last micro-batch) takes them when the last
  step asked for norms, unless its units are stepped during it (`step_during_backward`: nothing can ask after);
- an undeclared one takes them when the last step asked and did not declare its last micro-batch (a loop that
  never declares: every micro-batch may be the last, as before).
Before the first step the policy assumes both: norms are asked, and nothing is declared. A slot whose sum changed
without a norm has none (`unit.grad_norms[i] is None`); `norms_on_demand` takes it from wherever the sum is when
one is asked: the tier's tensor (host or device memory), the host cache (gradients held for the step), or the disk,
read into a buffer granted for the job. So a loop that changes its habits gets the same norms, a pass later. The
norms are torch's own `_foreach_norm` over the same fp32 sums either way: the same bits.
"""

from __future__ import annotations

import torch

from tightfit.offload.placement import State, Tier
from tightfit.offload.runtime.host_cache import HostCache
from tightfit.offload.runtime.host_memory import HostPool
from tightfit.offload.step.unit import GRADS, OffloadUnit
from tightfit.offload.step.units import slot_views


class NormPolicy:
    """When the gradient worker takes norms ([Note: norms when asked]); main thread. A step runs from the first
    backward after a `zero_grad` to the next `zero_grad`."""

    def __init__(self) -> None:
        self.asked = True  # did the last step ask for norms?
        self.declares = False  # did the last step declare its last micro-batch?
        self._asked = self._declared = False  # ... this step, so far
        self._backwards = 0  # the engine's backward count at the last roll-over

    def eager(self, declared: bool, early: bool) -> bool:
        """Take the norms of the running backward's sums? declared: a step is declared to follow it; early: its
        units are stepped during it."""
        if declared:
            return self.asked and not early
        return self.asked and not self.declares

    def on_declare(self) -> None:
        self._declared = True

    def on_ask(self) -> None:
        self._asked = True

    def end_step(self, backwards: int) -> None:
        """A step ends (`zero_grad`): what it did becomes the guess for the next. A `zero_grad` with no backward
        since the last (the loop's own after the optimizer's) changes nothing."""
        if backwards == self._backwards:
            return
        self._backwards = backwards
        self.asked, self.declares = self._asked, self._declared
        self._asked = self._declared = False


def record_norms(unit: OffloadUnit, views: list[torch.Tensor]) -> int:
    """Each parameter's gradient 2-norm from its accumulated values (`views`, per trainable slot). Returns the bytes
    read."""
    idx = [i for i, h in enumerate(unit.has_grad) if h]
    norms = torch._foreach_norm([views[i] for i in idx], 2.0) if idx else []
    for i, n in zip(idx, norms):
        unit.grad_norms[i] = n
    return sum(views[i].numel() * views[i].element_size() for i in idx)


def forget_norms(unit: OffloadUnit, slots) -> None:
    """The sums of `slots` changed and no norm was taken: a norm is taken on demand."""
    for i in slots:
        unit.grad_norms[i] = None


def norms_on_demand(unit: OffloadUnit, cache: HostCache, pool: HostPool) -> int:
    """Take the norms the gradient worker did not, from wherever the unit's sums are now. Main thread, after every
    gradient has landed (`wait_grads`), holding no grant: the disk's case is granted a buffer as a job is. Returns
    the bytes the host's cores read (none for sums in device memory)."""
    if not any(h and n is None for h, n in zip(unit.has_grad, unit.grad_norms)):
        return 0
    store = unit.store[State.GRADS]
    if store.tensor(unit.name, GRADS) is not None:  # host or device memory
        read = record_norms(unit, unit.stored_views(State.GRADS, GRADS))
        return 0 if unit.placement.grads == Tier.DEVICE else read
    held = cache.take(unit.name, GRADS, unit.version)
    if held is not None:  # the final sums, held for the step
        for f in held.pending():
            f.result()
        read = record_norms(unit, slot_views(unit.trainable, held.buf))
        cache.put(unit.name, GRADS, held)
        return read
    grant = pool.reserve(f"gradient norms of {unit.name}", {GRADS: unit.jobs["ship"][GRADS]})
    try:
        buf = grant[GRADS]
        store.load(unit.name, GRADS, buf).result()
        return record_norms(unit, slot_views(unit.trainable, buf))
    finally:
        grant.release()
