"""A unit's CPU step a span at a time ([Note: one pass in cache], offload/step/adamw.py): the multiply, AdamW and the
cast run span by span and give torch's bits. The test models' units are smaller than a span, so the span is made
48 elements here (a multiple of 16, as `SPAN` is): every parameter is cut into pieces, across span edges."""

from __future__ import annotations

import pytest
import torch

import tightfit
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, loss_of, tier_placements, tiny_gpt, train
from tightfit.offload.step import adamw
from tightfit.offload.step.engine import engine_of
from tightfit.optim import AdamW


@pytest.fixture
def spans(monkeypatch) -> list[int]:
    """Spans of 48 elements; the list counts the unit steps that ran in spans."""
    ran: list[int] = []
    real = adamw._pieces
    monkeypatch.setattr(adamw, "SPAN", 48)
    monkeypatch.setattr(adamw, "_pieces", lambda unit, groups: (ran.append(1), real(unit, groups))[1])
    return ran


@pytest.mark.parametrize("device_memory", ["separate", "shared"])
@pytest.mark.parametrize("where", ["nvme", "host", "mixed"])
def test_a_clipped_step_in_spans_is_torchs(where, device_memory, tmp_path, monkeypatch, spans):
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", device_memory)
    expected, *_ = train(tiny_gpt, steps=4, accum=2, clip=0.05)
    losses, model, _ = train(tiny_gpt, tier_placements(tmp_path)[where], steps=4, accum=2, clip=0.05)
    assert losses == expected
    assert spans  # the span path ran
    engine_of(model).close()


@pytest.mark.parametrize("where", ["nvme", "host"])
def test_a_bf16_step_casts_span_by_span_to_the_same_bits(where, tmp_path, monkeypatch):
    """bf16 compute: a separate fp32 master, cast to the compute copy after each span's step (into the step's
    granted buffer, or in place in the copy's tier). The same losses as the whole-unit step, bit for bit."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    runs = {}
    for span in (adamw.SPAN, 48):
        monkeypatch.setattr(adamw, "SPAN", span)
        losses, model, _ = train(tiny_gpt, tier_placements(tmp_path / str(span))[where], steps=4, accum=2, clip=0.05,
                                 compute_dtype=torch.bfloat16)
        runs[span] = losses
        engine_of(model).close()
    assert runs[48] == runs[adamw.SPAN]


def test_parameter_groups_in_spans(tmp_path, monkeypatch, spans):
    """Two groups (decay on the matrices, none on the rest, each its own learning rate) interleave in a unit's flat
    buffer, so a span holds pieces of both: each group's pieces step with its own hyperparameters. Clipped: with
    fp32 params that are their own master, a step without a multiplier has no second pass to save, and no spans."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")

    def groups(model):
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return [dict(params=decay, weight_decay=0.1, lr=1e-2), dict(params=rest, weight_decay=0.0, lr=3e-3)]

    losses = {}
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = tiny_gpt()
        if wrapped:
            tightfit.wrap(model, tier_placements(tmp_path)["nvme"])
            opt = AdamW(groups(model))
        else:
            opt = torch.optim.AdamW(groups(model), fused=True)
        losses[wrapped] = []
        for step in range(4):
            loss = loss_of(model, *batch(step))
            loss.backward()
            losses[wrapped].append(loss.item())
            if wrapped:
                opt.clip_grad_norm_(0.05)  # a multiplier: the step runs in spans
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    assert losses[True] == losses[False]
    assert spans
