"""Gradient norms taken where a step asks for them, and on demand otherwise ([Note: norms when asked],
offload/step/grad_norms.py): the same clipping, bit for bit, with fewer passes over the sums."""

from __future__ import annotations

import pytest
import torch

import tightfit
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, loss_of, tier_placements, tiny_gpt, train
from tightfit import Placement
from tightfit.offload.step import gradients
from tightfit.optim import AdamW

ACCUM = 2
# Per step: (declare the last micro-batch, clip). Each of the policy's cases comes up: norms taken on every
# micro-batch (steps 0 and 4), on the declared one only (1, 5), on none and then on demand from the sums held for
# the step, the tier's memory or the disk (2: the last step asked for none; 3: the loop stopped declaring).
SCHEDULE = [(True, True), (True, False), (True, True), (False, True), (False, True), (True, True)]
CLIP = 0.05  # binds at every clipped step


def _run(model, opt, wrapped: bool, schedule=SCHEDULE, early: bool = False) -> list[float]:
    losses = []
    for step, (declare, clip) in enumerate(schedule):
        total = 0.0
        for micro in range(ACCUM):
            x, y = batch(step * ACCUM + micro)
            loss = loss_of(model, x, y) / ACCUM
            if wrapped and declare and micro == ACCUM - 1:
                opt.step_during_backward() if early else opt.preload_during_backward()
            loss.backward()
            total += loss.item()
        if clip and wrapped:
            opt.clip_grad_norm_(CLIP)
        elif clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return _run(model, opt, wrapped=False)


def _wrapped(placement: Placement, dtype=torch.float32):
    torch.manual_seed(0)
    model = tiny_gpt()
    tightfit.wrap(model, placement, compute_dtype=dtype)
    return model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.fixture
def norm_passes(monkeypatch) -> list[str]:
    """The units whose sums' norms the gradient worker (or the in-place add) took, in order."""
    taken: list[str] = []
    real = gradients.record_norms
    monkeypatch.setattr(gradients, "record_norms", lambda unit, views: (taken.append(unit.name), real(unit, views))[1])
    return taken


@pytest.mark.parametrize("device_memory", ["separate", "shared"])
@pytest.mark.parametrize("where", ["nvme", "host", "mixed"])
def test_norms_on_demand_clip_as_torch_does(where, device_memory, tmp_path, monkeypatch, norm_passes):
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", device_memory)
    expected = _reference()
    model, opt = _wrapped(tier_placements(tmp_path)[where])
    assert _run(model, opt, wrapped=True) == expected
    assert norm_passes  # the worker took some (steps 0, 4, 5) ...
    tightfit.offload.step.engine.engine_of(model).close()


def test_the_worker_takes_norms_only_for_the_micro_batch_a_step_asks_about(tmp_path, monkeypatch, norm_passes):
    """A loop that declares its last micro-batch and clips: after its first step, one norm pass per unit and step
    (the last micro-batch's), where every micro-batch used to take one."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    model, opt = _wrapped(tier_placements(tmp_path)["nvme"])
    units = len(tightfit.offload.step.engine.engine_of(model).units)
    steps = [(True, True)] * 3
    per_step = []
    for schedule in ([steps[0]], steps[1:2], steps[2:]):
        norm_passes.clear()
        _run(model, opt, wrapped=True, schedule=schedule)
        per_step.append(len(norm_passes))
    assert per_step == [ACCUM * units, units, units]


def test_a_step_during_backward_takes_no_norm(tmp_path, monkeypatch, norm_passes):
    """Stepped as their gradients land, the units' sums are gone before anything could ask for their norms; the
    losses stay torch's."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    expected, *_ = train(tiny_gpt, steps=3, accum=ACCUM)
    model, opt = _wrapped(tier_placements(tmp_path)["host"])
    norm_passes.clear()
    losses = _run(model, opt, wrapped=True, schedule=[(True, False)] * 3, early=True)
    assert losses == expected
    units = len(tightfit.offload.step.engine.engine_of(model).units)
    assert len(norm_passes) == units * (ACCUM - 1)  # the first step's undeclared micro-batch only


def test_bf16_norms_on_demand_match_the_workers(tmp_path, monkeypatch, norm_passes):
    """bf16 compute, gradients on the disk: the norms taken on demand (read back from the disk) are those the worker
    takes, bit for bit. Two models trained alike; after a step that asked for no norm, one has its worker told that
    norms will be asked."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    got, passes = [], []
    for told in (False, True):
        model, opt = _wrapped(tier_placements(tmp_path / str(told))["nvme"], torch.bfloat16)
        _run(model, opt, wrapped=True, schedule=[(True, False)])
        engine = tightfit.offload.step.engine.engine_of(model)
        engine.wait_steps()  # the last step's (queued for the next forward), and the gradients it waited for
        engine.norms.asked = told
        norm_passes.clear()
        for micro in range(ACCUM):
            if micro == ACCUM - 1:
                opt.preload_during_backward()
            (loss_of(model, *batch(10 + micro)) / ACCUM).backward()
        engine.wait_grads()
        passes.append(len(norm_passes))
        got.append([float(n) for n in opt.grad_norms()])
        opt.zero_grad()
        engine.close()
    assert passes == [0, len(engine.units)]
    assert got[0] == got[1] and len(got[0]) > 3
