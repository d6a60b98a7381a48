"""The hooks that tell the engine where the model is in its step. They hold no data and decide nothing.

Why apart from the engine: these functions are the only code that knows about PyTorch's hook APIs; the engine
sees five events: root forward start/end, unit forward start/end, unit backward start, a gradient arrived, a
unit's input gradients are done. The backward events:
- *unit backward start*: a multi-grad hook ("any") on the unit's forward outputs fires when the first gradient
  reaches them, i.e. right before autograd runs the unit's backward; the engine re-materialises the unit there.
- *gradient arrived*: `register_post_accumulate_grad_hook` on each trainable parameter fires once per backward,
  after its gradient is complete in `param.grad`.
- *input gradients done*: a multi-grad hook ("all") on the unit's floating inputs fires after the unit's backward
  has produced the gradients of its inputs: nodes of the unit that needed its parameters have run by then.
- *end of backward*: a callback queued on autograd's engine flushes what the per-unit events did not.

Activation checkpointing wraps the unit's `forward` (an attribute of the module instance, removed by
`unwrap_hooks`) in non-reentrant `torch.utils.checkpoint`; the recomputation calls the original forward from
inside the unit's backward, after the unit-backward-start event has re-materialised the parameters.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint


def _grad_tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def on_grads_of_all(tensors: list[torch.Tensor], fn) -> None:
    """Call `fn()` once every tensor in `tensors` has received its gradient in backward.

    Why not `torch.autograd.graph.register_multi_grad_hook(mode="all")`: its closure keeps the tensors' autograd
    nodes alive from a hook stored on those same nodes — a reference cycle through C++ that Python's garbage
    collector cannot see, so every step leaked part of its graph (measured: ~1.3 MB of RSS per step on the
    reference GPT, tests/test_offload_leak.py). This hook holds no node. It expects every tensor to be reached by
    backward (a unit's inputs on the path to the loss are); a unit whose count is never reached is finished by
    the end-of-backward callback instead, as before.
    """
    remaining = [len(tensors)]
    lock = threading.Lock()  # backward may run hooks on several threads (one per device)

    def hook(_grad: torch.Tensor) -> None:
        with lock:
            remaining[0] -= 1
            done = remaining[0] == 0
        if done:
            fn()

    for t in tensors:
        t.register_hook(hook)


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Names Hugging Face layers give the key/value cache they update during forward (they differ by model/version)."""


def _checkpointed(forward, module):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # A layer that writes a key/value cache in forward would write it again in the recomputation (T5's decoder:
        # torch's CheckpointError, a different number of saved tensors). As Hugging Face's own gradient
        # checkpointing does (GradientCheckpointingLayer), the checkpointed call runs without the cache.
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(module, "_can_checkpoint_with_cache", False):
            for name in _CACHE_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def register_hooks(engine) -> list:
    """Install every hook the engine needs; returns the handles (removed by `remove_hooks`)."""
    handles = []
    model = engine.model

    def root_pre(module, args, kwargs):
        engine.on_root_forward_start()

    def root_post(module, args, kwargs, output):
        engine.on_root_forward_end()

    handles.append(model.register_forward_pre_hook(root_pre, with_kwargs=True))
    handles.append(model.register_forward_hook(root_post, with_kwargs=True))

    for unit in engine.units.values():
        if unit.spec.is_root:
            continue

        def pre(module, args, kwargs, unit=unit):
            engine.on_unit_forward_start(unit)
            if torch.is_grad_enabled():
                inputs = _grad_tensors((args, kwargs))
                if inputs:
                    unit.open_calls += 1
                    on_grads_of_all(inputs, lambda unit=unit: engine.on_unit_inputs_grad(unit))

        def post(module, args, kwargs, output, unit=unit):
            outputs = _grad_tensors(output)
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad, unit=unit: engine.on_unit_backward_start(unit), mode="any")
            engine.on_unit_forward_end(unit)

        def inner_pre(module, args, kwargs, unit=unit):
            # A later member of a group ([Note: grouped blocks]): the unit is materialised since its first member
            # ran; this only re-materialises it if something (an out-of-order call) released it in between.
            engine.materialise(unit)

        modules = unit.spec.modules
        handles.append(modules[0].register_forward_pre_hook(pre, with_kwargs=True))
        for module in modules[1:]:
            handles.append(module.register_forward_pre_hook(inner_pre, with_kwargs=True))
        handles.append(modules[-1].register_forward_hook(post, with_kwargs=True))

    for unit in engine.units.values():
        for i, slot in enumerate(unit.trainable):
            handles.append(slot.param.register_post_accumulate_grad_hook(
                lambda p, unit=unit, i=i: engine.on_grad(unit, i)))

    for name in engine.placement.checkpoint_units:
        for module in engine.units[name].spec.modules:
            module.forward = _checkpointed(module.forward, module)
    return handles


def remove_hooks(engine, handles: list) -> None:
    for h in handles:
        h.remove()
    for name in engine.placement.checkpoint_units:
        for module in engine.units[name].spec.modules:
            module.__dict__.pop("forward", None)


def queue_end_of_backward(callback) -> None:
    """Run `callback` when the current backward pass finishes (call from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
