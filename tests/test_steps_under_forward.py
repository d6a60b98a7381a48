"""The optimizer's steps under the next forward ([Note: steps under the next forward] in offload/step/engine.py):
`opt.step()` queues each unit's step on the step thread in the next forward's order and returns; the next forward
waits for a unit's step only when it reaches that unit. The results are torch's, bit for bit, whether clipping
binds or not, with the learning rate changed before the queued steps run, and with the workers' starts delayed at
random (the strict mode the suite runs in)."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

import tightfit
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, loss_of, tiny_gpt, tier_placements
from tightfit import Placement, Tier
from tightfit.offload.step import optimizer as step_optimizer
from tightfit.offload.step.engine import engine_of
from tightfit.optim import AdamW


def _run(placement, clips, lrs, *, early=False, poison=None):
    """Losses and final weights of one step per entry of `clips` (None: no clip) and `lrs` (the learning rate set
    before each step, as a schedule does); plain PyTorch when `placement` is None. `poison(model, step)`: makes
    that step's gradients non-finite."""
    torch.manual_seed(0)
    model = tiny_gpt()
    if placement is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.1, fused=True)
    else:
        tightfit.wrap(model, placement, device="cpu")
        opt = AdamW(model.parameters(), lr=lrs[0], weight_decay=0.1)
    losses, norms = [], []
    for step, (clip, lr) in enumerate(zip(clips, lrs)):
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_of(model, *batch(step))
        if poison is not None:
            loss = loss * poison(step)
        if placement is not None and early:
            opt.step_during_backward()
        elif placement is not None:
            opt.preload_during_backward()
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if placement is None
                               else opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if placement is not None:
        engine_of(model).close()
    return losses, norms, weights


LRS = [1e-2, 3e-2, 5e-3, 2e-2, 1e-2, 4e-2]


@pytest.mark.parametrize("where", ["nvme", "host", "mixed"])
def test_clipped_steps_that_bind_and_do_not_are_torchs(where, tmp_path):
    """max_norm 0.5 binds on the first steps' gradients, 50 binds on none, 1.0 on some: each is torch's clip then
    step, with a new learning rate set before the queued steps ran."""
    clips = [0.5, 50.0, 1.0, 0.5, 50.0, 1.0]
    ref = _run(None, clips, LRS)
    got = _run(tier_placements(tmp_path)[where], clips, LRS)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert any(n > c for n, c in zip(ref[1], clips)) and any(n < c for n, c in zip(ref[1], clips))
    assert all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


def test_steps_during_backward_and_after_it_are_torchs(tmp_path):
    """No clip: each unit steps during backward, the root after it (its gradient lands last), all under the next
    forward if they have not run by then; a learning rate set meanwhile is the next step's."""
    ref = _run(None, [None] * 6, LRS)
    got = _run(tier_placements(tmp_path)["nvme"], [None] * 6, LRS, early=True)
    assert got[0] == ref[0] and all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


def test_a_non_finite_gradient_is_torchs_too(tmp_path):
    """A loss of inf at step 2: the gradients non-finite, the norm too, the clip's coefficient with it, as torch's
    clip does; the step is taken (tightfit train refuses the run there: the loop sees
    the norm, test_checkpoint_divergence.py). The weights are torch's, NaN where torch's are."""
    def poison(step):
        return math.inf if step == 2 else 1.0

    clips = [1.0] * 4
    ref = _run(None, clips, LRS[:4], poison=poison)
    got = _run(Placement.everywhere(Tier.HOST), clips, LRS[:4], poison=poison)
    assert not math.isfinite(ref[1][2]) and not math.isfinite(got[1][2])
    for k in ref[2]:
        torch.testing.assert_close(got[2][k], ref[2][k], rtol=0, atol=0, equal_nan=True)


def test_the_next_forward_waits_for_a_units_step_only_when_it_reaches_it(monkeypatch):
    """The last block's step is made slow: the next forward computes the root and the first blocks while it runs,
    and waits at the last block. The steps run in the next forward's order (root first)."""
    model = tiny_gpt()
    tightfit.wrap(model, Placement.everywhere(Tier.HOST), device="cpu")
    engine = engine_of(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    events: list[tuple[str, float]] = []
    real = step_optimizer.StepRunner.step_one

    def slow(self, unit, groups, scales):
        if unit.name == "blocks.2":
            time.sleep(0.3)
        out = real(self, unit, groups, scales)
        events.append((f"stepped {unit.name}", time.perf_counter()))
        return out

    monkeypatch.setattr(step_optimizer.StepRunner, "step_one", slow)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: events.append((f"forward blocks.{i}", time.perf_counter())))
    loss_of(model, *batch(0)).backward()  # the first step records the order units run in
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    engine.wait_steps()
    events.clear()
    opt.preload_during_backward()
    loss_of(model, *batch(1)).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    assert all(u.stepping is not None for u in engine.units.values())  # queued, none awaited
    opt.zero_grad()
    loss_of(model, *batch(2))  # the next forward
    names = [e for e, _ in events]
    assert [n for n in names if n.startswith("stepped")] == ["stepped root", "stepped blocks.0", "stepped blocks.1",
                                                             "stepped blocks.2"]
    at = dict(events)
    assert at["forward blocks.0"] < at["stepped blocks.2"] - 0.2  # computed while the slow step ran
    assert at["forward blocks.2"] >= at["stepped blocks.2"]  # ... and waited for it there
    assert engine.timings()["optimizer_exposed_s"] > 0.1
    engine.close()


def test_reads_between_steps_wait_for_the_queued_steps(tmp_path):
    """A state dict, a parameter read and a checkpoint export right after `opt.step()` see the stepped values."""
    from tightfit.offload.model_state.state_io import export_state

    clips = [1.0, 1.0]
    _, _, ref = _run(None, clips, LRS[:2])
    for read in ("state_dict", "param", "export"):
        torch.manual_seed(0)
        model = tiny_gpt()
        tightfit.wrap(model, tier_placements(tmp_path / read)["nvme"], device="cpu")
        opt = AdamW(model.parameters(), lr=LRS[0], weight_decay=0.1)
        for step in range(2):
            for group in opt.param_groups:
                group["lr"] = LRS[step]
            loss_of(model, *batch(step)).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        if read == "state_dict":
            got = model.state_dict()
        elif read == "param":
            with torch.no_grad():
                got = {k: p.detach().clone() for k, p in model.named_parameters()}
        else:
            got = {k[len("model."):]: v for k, v in export_state(model, opt) if k.startswith("model.")}
        assert all(torch.equal(got[k], ref[k]) for k in got), read
        assert not [t for t in threading.enumerate() if t.name == "tightfit-step" and not t.daemon]
        engine_of(model).close()


def test_a_forward_runs_a_step_that_has_not_started_itself(monkeypatch):
    """[Note: a step run by the thread that waits for it]: with the step thread held busy, each forward reaches units
    whose queued steps have not started and runs them on its own thread instead of waiting; the losses, norms and
    weights are torch's. Without it the forward waits until the hold times out and the step thread runs them."""
    clips = [1.0, 0.5, 50.0, 1.0]
    ref = _run(None, clips, LRS[:4])
    ran_on: dict[str, set[str]] = {}
    real = step_optimizer.StepRunner.step_one

    def recorded(self, unit, groups, scales):
        ran_on.setdefault(unit.name, set()).add(threading.current_thread().name)
        return real(self, unit, groups, scales)

    monkeypatch.setattr(step_optimizer.StepRunner, "step_one", recorded)
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "shared")  # the CPU's own path (the suite runs the GPU's by default)
    torch.manual_seed(0)
    model = tiny_gpt()
    tightfit.wrap(model, Placement.everywhere(Tier.HOST), device="cpu")
    engine = engine_of(model)
    assert not engine.separate
    opt = AdamW(model.parameters(), lr=LRS[0], weight_decay=0.1)
    losses, norms, held = [], [], []
    for step, (clip, lr) in enumerate(zip(clips, LRS)):
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_of(model, *batch(step))  # the forward: runs the last step's queued steps where they wait
        losses.append(loss.item())
        opt.preload_during_backward()
        loss.backward()
        norms.append(float(opt.clip_grad_norm_(clip)))
        if step > 0:
            for hold in held:  # the step thread free again: the steps still queued run there
                hold.set()
            engine.wait_steps()
        hold, holding = threading.Event(), threading.Event()
        engine.step_worker.submit("hold", lambda hold=hold, holding=holding: holding.set() or hold.wait(5))
        assert holding.wait(10)  # the step thread is busy with the hold: the steps queued next cannot start there
        held.append(hold)
        opt.step()
        opt.zero_grad()
        if step == len(clips) - 1:
            with torch.no_grad():
                loss_of(model, *batch(step + 1))  # the last steps' forward, the hold still on
            hold.set()
    engine.wait_steps()
    assert losses == ref[0] and norms == ref[1]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(weights[k], ref[2][k]) for k in ref[2])
    main = threading.current_thread().name
    assert all(main in threads for threads in ran_on.values()), ran_on
    engine.close()
