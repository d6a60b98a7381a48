"""One unit's AdamW step: torch's fused kernel over the unit's flat buffers, the gradient multipliers before it and
the cast of the new master to the compute copy after it; on the CPU, a span of the flat buffers at a time.

[Note: one pass in cache] A step on the CPU makes up to three passes over the unit's states: the multipliers (the
clip coefficient, the loss scale's inverse) read and write the gradients, AdamW reads master, gradients and moments
and writes master and moments, and where the compute copy is not the master the new master is read again and
written at the compute dtype. A large unit's buffers do not fit any cache, so run one after another each pass
reads its operands from memory, and on a GPU machine those passes are the CPU's critical path ([Note: host passes]
in planner/costs.py). Run a span of `SPAN` elements at a time, the multiply leaves its span's gradients in cache
for AdamW, and AdamW leaves its span's master there for the cast: the same kernels on the same elements, so the
same bits, and two reads fewer per parameter from memory (benchmarks/RESULTS.md, batch X, on the 2-core VM: the
kernels alone over 64 M elements -8 to -12% with a clip and a bf16 cast, -6 to -8% without the clip; the engine's
`opt.step()` of two 50 M-parameter units -8 to -10% with the clip binding, -2 to -5% without).

Bitwise: every kernel is elementwise. AdamW's CPU kernel runs a vectorised loop and a scalar tail over each range it
is given (its threads split a tensor on 16-element boundaries); a span starts on a multiple of `SPAN` in the flat
buffer and every parameter on a multiple of 16 (units.ALIGN), so within a parameter each piece starts on a multiple
of 16 of the parameter's own elements and only the parameter's last piece has a tail: the split of a whole tensor.
The test suite holds every step to torch's bits.

Where spans buy nothing they are not used: on the device (one multi-tensor launch is what a GPU wants), for a
unit no larger than one span, and with neither a multiplier nor a cast (AdamW alone reads each operand once).
"""

from __future__ import annotations

import torch

from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ, GRADS, OffloadUnit

SPAN = 1 << 20
"""Elements stepped at a time on the CPU: 16 MiB of fp32 master, gradients and moments, which a last-level cache
holds. 1 M and 256 K elements measured alike on a quiet machine; on a loaded one the smaller spans paid for their
calls (batch X)."""

Groups = list[tuple[dict, list[int]]]
"""Per parameter group, the indices (into unit.trainable) of the slots to step."""


def step_unit(unit: OffloadUnit, tensors: dict[str, torch.Tensor], views: dict[str, list[torch.Tensor]],
              groups: Groups, scales: list[torch.Tensor], cast_to: torch.Tensor | None) -> None:
    """Step `groups` of `unit`: gradients times each of `scales`, then AdamW, then (`cast_to`: a flat buffer of the
    compute dtype) the new master's trainable prefix cast into `cast_to`. `tensors`: entry -> the flat buffer the step
    works on (master entry, grads, moments); `views`: entry -> its trainable slots' views."""
    master_entry = unit.master_entry
    device = tensors[master_entry].device
    for _, idx in groups:
        for i in idx:
            if unit.steps[i] is None:
                unit.steps[i] = torch.tensor(0.0, dtype=torch.float32, device=device)
            elif unit.steps[i].device != device:  # imported from a checkpoint
                unit.steps[i] = unit.steps[i].to(device)
        torch._foreach_add_([unit.steps[i] for i in idx], 1)
    nt = unit.spec.train_numel
    if device.type != "cpu" or nt <= SPAN or not (scales or cast_to is not None):
        master, grads, m, v = (views[e] for e in (master_entry, GRADS, EXP_AVG, EXP_AVG_SQ))
        for group, idx in groups:
            _multiply_and_step(group, [master[i] for i in idx], [grads[i] for i in idx], [m[i] for i in idx],
                               [v[i] for i in idx], [unit.steps[i] for i in idx], scales)
        if cast_to is not None:
            cast_to[:nt].copy_(tensors[master_entry][:nt])
        return
    master, grads, m, v = (tensors[e] for e in (master_entry, GRADS, EXP_AVG, EXP_AVG_SQ))
    for k, per_group in enumerate(_pieces(unit, groups)):
        for group, pieces in per_group:
            _multiply_and_step(group, [master[a:b] for _, a, b in pieces], [grads[a:b] for _, a, b in pieces],
                               [m[a:b] for _, a, b in pieces], [v[a:b] for _, a, b in pieces],
                               [unit.steps[i] for i, _, _ in pieces], scales)
        if cast_to is not None:  # the span's slots not stepped now are cast too, unchanged, as the whole cast does
            start, end = k * SPAN, min((k + 1) * SPAN, nt)
            cast_to[start:end].copy_(master[start:end])


def _multiply_and_step(group: dict, master, grads, m, v, steps, scales: list[torch.Tensor]) -> None:
    """Torch's order: the gradients multiplied (loss-scale inverse, clip coefficient), then `_fused_adamw_`, the
    kernel `torch.optim.AdamW(fused=True)` runs, with the step counts already advanced."""
    for scale in scales:
        torch._foreach_mul_(grads, scale)
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(master, grads, m, v, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def _pieces(unit: OffloadUnit, groups: Groups) -> list[list[tuple[dict, list[tuple[int, int, int]]]]]:
    """Per span of the flat buffers, per group with slots there: (slot index, first, end) of each slot's part of the
    span, in flat elements."""
    spans: list[list] = [[] for _ in range(-(-unit.spec.train_numel // SPAN))]
    for group, idx in groups:
        per_span: dict[int, list[tuple[int, int, int]]] = {}
        for i in idx:
            slot = unit.trainable[i]
            first, end = slot.offset, slot.offset + slot.numel
            while first < end:
                k = first // SPAN
                last = min(end, (k + 1) * SPAN)
                per_span.setdefault(k, []).append((i, first, last))
                first = last
        for k, pieces in per_span.items():
            spans[k].append((group, pieces))
    return spans
