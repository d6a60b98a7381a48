"""Consecutive blocks joined into one unit (`Placement.min_unit_bytes`, [Note: grouped blocks] in units.py).

A group is the engine's unit in every respect (one flat buffer per state, one file on the NVMe tier, one fetch per
forward), so the same fidelity bar holds: losses bitwise equal to torch.optim.AdamW(fused=True).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, hf_gpt2, hf_llama, loss_of, tiny_gpt, train
import tightfit
from tightfit import Placement, Tier, UnitPlacement
from tightfit.offload.step.engine import engine_of
from tightfit.offload.step.units import find_units, group_blocks

BLOCK = 4 * sum(p.numel() for p in tiny_gpt().blocks[0].parameters())
"""fp32 bytes of one block of the tiny GPT; min_unit_bytes = BLOCK + 1 joins blocks in pairs."""

_refs: dict = {}


def reference(build, **kw) -> list[float]:
    key = (build.__name__, tuple(sorted(kw.items())))
    if key not in _refs:
        _refs[key] = train(build, **kw)[0]
    return _refs[key]


def nvme(tmp_path, **kw) -> Placement:
    return Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), min_unit_bytes=BLOCK + 1, **kw)


def test_group_blocks_joins_consecutive_siblings_with_equal_key():
    blocks = [("b.0", 5), ("b.1", 5), ("b.2", 5), ("b.3", 5), ("b.4", 5), ("c.0", 1), ("b.6", 30)]
    assert group_blocks(blocks, 10) == {"b.0-1": ["b.0", "b.1"], "b.2-3": ["b.2", "b.3"], "b.4": ["b.4"],
                                        "c.0": ["c.0"], "b.6": ["b.6"]}
    # A block whose key differs (its placement or checkpointing) starts a group of its own.
    assert group_blocks(blocks[:4], 100, key=lambda p: p == "b.2") == {
        "b.0-1": ["b.0", "b.1"], "b.2": ["b.2"], "b.3": ["b.3"]}
    assert group_blocks(blocks[:3], 1) == {"b.0": ["b.0"], "b.1": ["b.1"], "b.2": ["b.2"]}


def test_find_units_groups_the_default_and_an_explicit_policy():
    model = tiny_gpt()
    specs = find_units(model, min_bytes=BLOCK + 1)
    assert [(s.name, [p for p, _ in s.members]) for s in specs] == [
        ("root", []), ("blocks.0-1", ["blocks.0", "blocks.1"]), ("blocks.2", ["blocks.2"])]
    owned = [slot.name for s in specs for slot in s.slots]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert {slot.name.split(".")[1] for slot in specs[1].slots} == {"0", "1"}
    # An explicit policy's blocks are grouped the same way (issue 16: min_bytes did nothing with a unit list).
    assert [s.name for s in find_units(model, ["blocks.*"], min_bytes=BLOCK + 1)] == [
        "root", "blocks.0-1", "blocks.2"]


@pytest.mark.parametrize("early", [False, True])
def test_grouped_units_match_plain_pytorch(early, tmp_path):
    losses, model, _ = train(tiny_gpt, nvme(tmp_path), accum=2, early=early)
    assert list(engine_of(model).units) == ["root", "blocks.0-1", "blocks.2"]
    assert losses == reference(tiny_gpt, accum=2), "bitwise equal to torch.optim.AdamW(fused=True)"
    engine_of(model).close()


def test_grouped_units_with_checkpointing_clipping_and_preload(tmp_path):
    kw = dict(accum=2, clip=0.05)
    placement = nvme(tmp_path, checkpoint_units=["blocks.0", "blocks.1", "blocks.2"])
    losses, model, _ = train(tiny_gpt, placement, preload=True, **kw)
    engine = engine_of(model)
    assert engine.placement.checkpoint_units == ["blocks.0-1", "blocks.2"]
    assert losses == reference(tiny_gpt, **kw)
    engine.close()


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama])
def test_grouped_hf_blocks_match_plain_pytorch(build, tmp_path):
    block = 4 * sum(p.numel() for p in next(m for m in build().modules()
                                             if isinstance(m, torch.nn.ModuleList))[0].parameters())
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), min_unit_bytes=block + 1)
    losses, model, _ = train(build, placement, early=True)
    assert len(engine_of(model).units) == 2  # root + both blocks in one unit
    assert losses == reference(build)
    engine_of(model).close()


def test_a_block_placed_apart_is_not_joined(tmp_path):
    host = UnitPlacement.all_on(Tier.HOST)
    placement = nvme(tmp_path, units={"blocks.1": host})
    placement.min_unit_bytes = 10 * BLOCK
    losses, model, _ = train(tiny_gpt, placement)
    engine = engine_of(model)
    assert list(engine.units) == ["root", "blocks.0", "blocks.1", "blocks.2"]
    assert engine.units["blocks.1"].placement == host
    assert losses == reference(tiny_gpt)
    engine.close()
    placement = nvme(tmp_path, units={"blocks.0": host, "blocks.1": host})
    placement.min_unit_bytes = 10 * BLOCK
    losses, model, _ = train(tiny_gpt, placement)
    engine = engine_of(model)
    assert list(engine.units) == ["root", "blocks.0-1", "blocks.2"]
    assert engine.units["blocks.0-1"].placement == host and engine.units["blocks.2"].placement.params == Tier.NVME
    engine.close()


def test_a_group_is_one_file_and_one_fetch_per_forward(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt()
    tightfit.wrap(model, nvme(tmp_path), device="cpu")
    engine = engine_of(model)
    with safe_open(str(engine.stores[Tier.NVME].nvme.path("blocks.0-1")), "pt") as f:  # in the run's subfolder
        assert set(f.keys()) >= {"params", "grads", "exp_avg", "exp_avg_sq"}
        assert f.get_slice("params").get_shape() == [engine.units["blocks.0-1"].spec.numel]
    disk = engine.stores[Tier.NVME].nvme
    before = disk.stats()["bytes_read"]
    with torch.no_grad():
        loss_of(model, *batch(0))
    read = disk.stats()["bytes_read"] - before
    # Every unit's parameters read once: the group's second block computes with what its first one fetched.
    assert read == sum(4 * u.spec.numel for u in engine.units.values())
    engine.close()
