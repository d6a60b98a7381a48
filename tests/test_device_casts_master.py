"""[Note: the device casts the master] (offload/step/unit.py): with `Placement.cast_on_device`, a unit whose params and
master are on the host tier keeps no compute copy there; a fetch uploads the fp32 master (page-locked) and the
device casts it, a chunk at a time; the CPU's step casts nothing. Run on the CPU suite's GPU-shaped device (device
memory apart from the host's, the strict mover's late copies), against the same model with every state on the device
and against the host compute copy, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offload_helpers import batch, continue_training, loss_of, tiny_gpt, train

from tightfit import Placement, Tier, wrap
from tightfit.offload import memory_model as mm
from tightfit.offload.model_state.state_io import export_state, import_state
from tightfit.offload.runtime import movers
from tightfit.offload.step import adamw
from tightfit.offload.step.engine import engine_of
from tightfit.optim import AdamW

BF16 = {"compute_dtype": torch.bfloat16, "steps": 3}


@pytest.fixture
def casts(monkeypatch):
    """The step's casts of a new master into a compute copy, counted; the GPU-shaped device."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    seen = {"casts": 0}
    step_unit = adamw.step_unit

    def counting(unit, tensors, views, groups, scales, cast_to):
        seen["casts"] += cast_to is not None
        return step_unit(unit, tensors, views, groups, scales, cast_to)

    monkeypatch.setattr(adamw, "step_unit", counting)
    monkeypatch.setattr("tightfit.offload.step.optimizer.step_unit", counting)
    return seen


@pytest.mark.parametrize("early", [False, True])
def test_the_device_casts_the_uploaded_master_with_the_same_bits(casts, early):
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), early=early, **BF16)
    host_copy, ref, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST), early=early, **BF16)
    assert casts["casts"] > 0  # the host compute copy: the step casts each unit's new master into it
    casts["casts"] = 0
    losses, model, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST, cast_on_device=True), early=early, **BF16)
    assert losses == expected == host_copy
    assert casts["casts"] == 0
    engine = engine_of(model)
    assert all(u.casts_on_device for u in engine.units.values())
    host = engine.stores[Tier.HOST]
    assert not any(entry == "params" for _, entry in host._tensors)  # no compute copy at rest
    assert {e for _, e in host._locked} == {"master", "grads"}  # the master is what the device copies from
    # What crossed to the device, fetch for fetch: fp32 masters, 4 bytes a parameter where the copy had 2.
    assert engine.mover.stats["bytes_to_device"] == 2 * engine_of(ref).mover.stats["bytes_to_device"] > 0


def test_a_state_dict_and_a_checkpoint_read_the_master(casts, tmp_path):
    """Values read outside a fetch (a state dict, the compute copy a parameter read sees) come from the master."""
    _, model, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST, cast_on_device=True), **BF16)
    _, ref, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST), **BF16)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.detach().cpu(), q.detach().cpu()), name  # the compute copy, outside forward


def test_a_unit_with_frozen_parameters_keeps_its_compute_copy(casts):
    """Frozen parameters have no master: such a unit keeps the host compute copy (and its cast)."""
    losses, model, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST, cast_on_device=True), freeze=("blocks.0.",),
                             **BF16)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), freeze=("blocks.0.",), **BF16)
    assert losses == expected
    units = engine_of(model).units
    assert not units["blocks.0"].casts_on_device and units["blocks.1"].casts_on_device


@pytest.mark.parametrize("chunk", [97, 4096])
def test_the_upload_in_chunks_is_the_whole_cast(casts, monkeypatch, chunk):
    """Both movers cast an uploaded master `CONVERT_CHUNK` elements at a time (the GPU's temporary's bound): with
    odd chunks, under the strict mover, the same bits."""
    monkeypatch.setattr(movers, "CONVERT_CHUNK", chunk)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **BF16)
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST, cast_on_device=True), **BF16)
    assert losses == expected


def test_the_memory_model_drops_the_copy_and_locks_the_master():
    page = mm.PAGE
    units = [mm.UnitSize("root", 1000, 1000), mm.UnitSize("blocks.0", 3000, 3000), mm.UnitSize("blocks.1", 3000, 2000)]
    host = Placement.everywhere(Tier.HOST)
    cast = Placement.everywhere(Tier.HOST, cast_on_device=True)
    def rnd(n):
        return -(-n // page) * page

    # blocks.1 has a frozen tail: it keeps its compute copy. The others: no params, the master page-locked.
    before = mm.tier_states(units, host, 2, separate=True)[Tier.HOST]
    after = mm.tier_states(units, cast, 2, separate=True)[Tier.HOST]
    assert before - after == (rnd(2000) + rnd(6000)) - (rnd(4000) + rnd(12000) - 4000 - 12000)
    assert mm.tier_states(units, cast, 4, separate=True) == mm.tier_states(units, host, 4, separate=True)  # fp32
    assert mm.upload_conversion_bytes(units, cast, 2) == 4 * 3000 and mm.upload_conversion_bytes(units, host, 2) == 0
    mem = mm.step_memory(units, cast, 2, cuda=True)
    assert mem.phases["forward"]["device"]["param conversion"] == 12000
    assert "param conversion" not in mem.phases["step"]["device"]
    assert "param conversion" not in mm.step_memory(units, cast, 2, cuda=False).phases["forward"]["device"]
    assert mem.engine_device() == mm.step_memory(units, host, 2, cuda=True).engine_device()


def test_a_plan_file_from_before_the_option_reads_as_off():
    assert Placement.from_dict({}).cast_on_device is False
    assert Placement.from_json(Placement(cast_on_device=True).to_json()).cast_on_device is True


def test_load_state_dict_writes_the_master_the_device_casts(casts):
    """A state dict loaded into such a unit goes to its master alone (there is no compute copy to write): the next
    forward computes with its cast, exactly as a bf16 copy of the source."""
    torch.manual_seed(5)
    source = tiny_gpt()
    torch.manual_seed(0)
    model = tiny_gpt()
    wrap(model, Placement.everywhere(Tier.HOST, cast_on_device=True), compute_dtype=torch.bfloat16, device="cpu")
    model.load_state_dict(source.state_dict())
    got = model.state_dict()
    for k, v in source.state_dict().items():
        assert torch.equal(got[k], v), k
    x, y = batch(3)
    with torch.no_grad():
        assert torch.equal(loss_of(model, x, y), loss_of(source.to(torch.bfloat16), x, y))


def test_a_checkpoint_resumes_exactly(casts):
    """export_state / import_state (what a checkpoint saves and a resume loads) of units whose device casts the
    master: three steps, a save, three more in a fresh model, the same losses as six steps in one go."""
    placement = Placement.everywhere(Tier.HOST, cast_on_device=True)
    ref, *_ = train(tiny_gpt, placement, compute_dtype=torch.bfloat16, steps=6)
    _, model, opt = train(tiny_gpt, placement, compute_dtype=torch.bfloat16, steps=3)
    saved = dict(export_state(model, opt))
    torch.manual_seed(1)  # other initial values: the import must replace them all
    fresh = wrap(tiny_gpt(), placement, compute_dtype=torch.bfloat16, device="cpu")
    opt2 = AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    import_state(fresh, opt2, saved.__getitem__)
    assert continue_training(fresh, opt2, range(3, 6)) == ref[3:]
