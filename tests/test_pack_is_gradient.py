"""A unit stepped during backward with one micro-batch a step takes its gradient pack as its gradients ([Note: the
pack is the gradient], offload/step/gradients.py): no widening into the host tier, the same bits."""

from __future__ import annotations

import pytest
import torch

from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, loss_of, tiny_gpt, train
from tightfit import Placement, Tier
from tightfit.offload.runtime.host_memory import Grant
from tightfit.offload.step import adamw, gradients
from tightfit.offload.step.engine import engine_of


@pytest.fixture
def widened(monkeypatch) -> list[str]:
    """The units whose packs the gradient worker widened into their tier."""
    names: list[str] = []
    real = gradients._add_into
    monkeypatch.setattr(gradients, "_add_into", lambda unit, *a: (names.append(unit.name), real(unit, *a))[1])
    return names


@pytest.fixture(autouse=True)
def gpu_path(monkeypatch):
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")  # packs, as on a GPU


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_one_micro_batch_stepped_during_backward_steps_from_the_pack(where, widened, tmp_path):
    expected, *_ = train(tiny_gpt, steps=4)
    placement = Placement.everywhere(Tier.HOST if where == "host" else Tier.NVME, nvme_dir=str(tmp_path))
    losses, model, _ = train(tiny_gpt, placement, steps=4, early=True)
    assert losses == expected
    assert widened == []  # no pack went through the tier or an accumulator
    engine_of(model).close()


@pytest.mark.parametrize("where", ["host", "nvme"])
@pytest.mark.parametrize("span", [adamw.SPAN, 48])
def test_a_bf16_pack_widened_by_the_step_gives_the_workers_bits(span, where, widened, monkeypatch, tmp_path):
    """bf16 packs: the step widens them span by span (48: every parameter in pieces) and gets the bits of a step
    from the sums the worker widened into the tier or an accumulator (the speculative bound refusing the hold, as it
    may)."""
    monkeypatch.setattr(adamw, "SPAN", span)
    kw = dict(steps=4, early=True, compute_dtype=torch.bfloat16)
    tier = Tier.HOST if where == "host" else Tier.NVME
    losses, model, _ = train(tiny_gpt, Placement.everywhere(tier, nvme_dir=str(tmp_path / "a")), **kw)
    engine_of(model).close()
    assert widened == []
    monkeypatch.setattr(Grant, "speculate", lambda self: False)
    widening, model, _ = train(tiny_gpt, Placement.everywhere(tier, nvme_dir=str(tmp_path / "b")), **kw)
    engine_of(model).close()
    assert widened and losses == widening


def test_a_held_pack_serves_norms_and_a_step_after_backward(monkeypatch):
    """A pack held for a step during backward that has not run yet: norms asked for then are torch's, from the
    pack, and a step after backward takes the pack as the early one would."""
    torch.manual_seed(0)
    plain = tiny_gpt()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    _, model, opt = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=0)
    engine = engine_of(model)
    monkeypatch.setattr(engine, "submit_early_step", lambda unit, run: None)  # held, and left for opt.step()
    x, y = batch(0)
    loss_of(plain, x, y).backward()
    opt.step_during_backward()
    loss_of(model, x, y).backward()
    engine.wait_grads()
    assert "grads" in engine.cache.entries("blocks.0")
    expected = [p.grad.norm() for p in plain.parameters()]
    assert [float(n) for n in opt.grad_norms()] == [float(n) for n in expected]
    opt.step()
    opt_plain.step()
    opt.zero_grad()
    opt_plain.zero_grad()
    assert loss_of(model, *batch(1)).item() == loss_of(plain, *batch(1)).item()
    engine.close()
