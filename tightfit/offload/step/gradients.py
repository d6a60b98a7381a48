"""Shipping a unit's gradients off the device as soon as its backward is done, accumulating on their tier.

Why right away: a unit's `param.grad`s are device memory the next units' backward needs. When the grads tier is
addressable where the gradients are (the device tier; the host tier on a CPU-only machine) they are added in place
at once. Otherwise the mover packs them into one pooled host buffer (CUDA: a D2H copy on its own stream; CPU: a
memcpy on a copy thread) and the engine's gradient worker adds them to the host tier, or reads-adds-writes them on
NVMe, while backward goes on. Accumulation is `old + new` in fp32, the same bits as torch's `param.grad += new`.
The worker records each parameter's gradient norm as it goes (clipping and overflow checks need no second pass
over the disk). When the optimizer has declared that a step follows this backward (`step_during_backward`,
`preload_during_backward`), a unit's final packed gradients go straight to its step through the host cache
(host_cache.py) instead of to disk and back.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from tightfit.offload.step.unit import GRADS, GradsState, OffloadUnit
from tightfit.offload.runtime.host_cache import Held
from tightfit.offload.placement import State

if TYPE_CHECKING:
    from tightfit.offload.step.engine import OffloadEngine


def ship_grads(engine: OffloadEngine, unit: OffloadUnit):
    """Move the unit's new `param.grad`s into its grads tier, accumulating; drop `param.grad`. Returns the
    Transfer of their copy off the device while it may still read them (None when they were used up at once)."""
    pairs = []
    for i in sorted(unit.got):
        slot = unit.trainable[i]
        g = slot.param.grad
        if g is not None:
            pairs.append((i, slot, g))
            slot.param.grad = None  # the device memory goes back as soon as the copy below has read it
    if not pairs:
        return None
    had = list(unit.has_grad)
    new = {i for i, _, _ in pairs}
    for i in new:
        unit.has_grad[i] = True
    acc = unit.store[State.GRADS].tensor(unit.name, GRADS)
    if acc is not None and acc.device == engine.device:
        # Addressable where the gradients are: accumulate in place now (ordered on the compute stream).
        for i, slot, g in pairs:
            view = slot.view(acc)
            view.add_(g) if had[i] else view.copy_(g)
        _record_norms(unit, acc)
        unit.grads_to(GradsState.STORED)
        return None
    # Packed in the gradients' own dtype (the compute dtype): the copy off the device converts nothing and moves
    # only their bytes; the worker upcasts to fp32 on the host, exactly (every bf16/fp16 value is an fp32 value).
    packed = engine.mover.pack_grads([((slot.offset, slot.shape), g) for _, slot, g in pairs], unit.spec.train_numel,
                                     pairs[0][2].dtype)
    unit.grads_to(GradsState.SHIPPING)
    # When a step follows this backward (declared by the optimizer), the unit's final gradients stay in the host
    # cache for it instead of making a round trip to disk, as far as the cache admits them.
    hold = engine.early_step is not None or engine.preload_step
    unit.grad_pending = engine.grad_worker.submit(_accumulate_off_device, engine, unit, packed, unit.grad_pending,
                                                  new, had, hold)
    return packed


def _accumulate_off_device(engine: OffloadEngine, unit: OffloadUnit, packed, previous: Future | None,
                           new: set[int], had: list[bool], hold: bool = False) -> None:
    """Grad worker: add a packed host copy of new gradients into the unit's host or disk gradient entry."""
    t0 = time.perf_counter()
    if previous is not None:
        previous.result()
    buf = packed.done.result()
    if buf.dtype != torch.float32:  # upcast on the host: the fp32 buffer is what gets accumulated and written
        wide = engine.pool.take(unit.spec.train_numel, torch.float32)
        for i in new:
            slot = unit.trainable[i]
            slot.view(wide).copy_(slot.view(buf))
        engine.pool.give(buf)
        buf = wide
    store = unit.store[State.GRADS]
    acc = store.tensor(unit.name, GRADS)
    if acc is not None:  # host memory
        for i in new:
            slot = unit.trainable[i]
            view = slot.view(acc)
            view.add_(slot.view(buf)) if had[i] else view.copy_(slot.view(buf))
        _record_norms(unit, acc)
    else:  # disk: read-modify-write through the packed buffer
        if any(had):
            held = engine.cache.take(unit.name, GRADS, unit.version)
            if held is not None:  # the last micro-batch was declared, and was not: they are here
                old = held.buf
            else:
                old = engine.pool.take(unit.spec.train_numel, torch.float32)
                store.load(unit.name, GRADS, old).result()
            for i, slot in enumerate(unit.trainable):
                if had[i] and i in new:
                    slot.view(buf).add_(slot.view(old))  # old + new: the same bits as torch's grad += new
                elif had[i]:
                    slot.view(buf).copy_(slot.view(old))
            engine.pool.give(old)
        _record_norms(unit, buf)
        # [Note: host cache admission]: held only while a step's working set stays free beside them.
        if hold and engine.cache.admit(buf.numel() * buf.element_size()):
            engine.cache.put(unit.name, GRADS, Held(buf, unit.version, only_copy=True))
            unit.grads_to(GradsState.HELD)
            engine._time("grad_accumulate_s", t0)
            return
        store.save(unit.name, GRADS, buf).result()
    engine.pool.give(buf)
    unit.grads_to(GradsState.STORED)
    engine._time("grad_accumulate_s", t0)


def _record_norms(unit: OffloadUnit, flat: torch.Tensor) -> None:
    """Each parameter's gradient 2-norm from the accumulated values in `flat` (for clipping, overflow checks)."""
    idx = [i for i, h in enumerate(unit.has_grad) if h]
    norms = torch._foreach_norm([unit.trainable[i].view(flat) for i in idx], 2.0) if idx else []
    for i, n in zip(idx, norms):
        unit.grad_norms[i] = n
