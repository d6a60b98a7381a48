"""ZeRO-1 over the offload engine, in one process ([Note: optimizer states sharded by unit] in
tightfit/parallel/sharded_optimizer.py): the units' owners, a placement's units stepped elsewhere, the memory a rank
no longer holds, and an engine that steps only its own units and takes the others' values as their owner made them.
The two-rank runs are in test_parallel_offload.py."""

from __future__ import annotations

import pytest
import torch

import tightfit
from offload_helpers import batch, loss_of, tiny_gpt
from tightfit import Placement, Tier
from tightfit.errors import UsageError
from tightfit.offload import memory_model as mm
from tightfit.offload.placement import State, UnitPlacement
from tightfit.offload.step.engine import engine_of
from tightfit.optim import AdamW
from tightfit.parallel.sharded_optimizer import owner_of, owners, shard_setup


def test_owners_balance_the_trainable_elements_largest_first():
    sizes = [("root", 100), ("blocks.0", 30), ("blocks.1", 30), ("blocks.2", 30), ("blocks.3", 60), ("frozen", 0)]
    two = owners(sizes, 2)
    assert two == {"root": 0, "blocks.3": 1, "blocks.0": 1, "blocks.1": 1, "blocks.2": 0}
    loads = [sum(n for name, n in sizes if two.get(name) == r) for r in range(2)]
    assert loads == [130, 120]  # the largest first, each to the least loaded rank
    assert "frozen" not in two  # every rank holds a frozen unit's values
    assert owners(list(reversed(sizes)), 2) == two  # the model alone decides: every rank computes the same
    assert owner_of("blocks.3.mlp.fc.tiles.1", two) == 1 and owner_of("lm_head.tiles.0", two) is None


def test_more_ranks_than_units_is_one_line():
    with pytest.raises(UsageError, match="3 trainable units for 4 ranks"):
        shard_setup(_two_blocks(), 0, 4)
    owner, elsewhere = shard_setup(_two_blocks(), 1, 2)
    assert elsewhere == {name for name, r in owner.items() if r != 1} and len(owner) == 3


def _two_blocks() -> torch.nn.Module:
    from tightfit.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_a_placement_names_the_units_stepped_elsewhere_and_their_groups_and_tiles():
    p = Placement(stepped_elsewhere=["blocks.1", "blocks.2"])
    assert p.steps_here("root") and p.steps_here("blocks.0") and not p.steps_here("blocks.1")
    assert not p.steps_here("blocks.2.mlp.fc.tiles.0")  # a tile of a block stepped elsewhere
    grouped = p.for_groups({"blocks.1-2": ["blocks.1", "blocks.2"], "blocks.0": ["blocks.0"]})
    assert grouped.stepped_elsewhere == ["blocks.1-2"] and not grouped.steps_here("blocks.1-2")
    assert Placement.from_json(p.to_json()).stepped_elsewhere == ["blocks.1", "blocks.2"]


def test_a_unit_stepped_elsewhere_holds_no_master_or_moments():
    up = UnitPlacement.all_on(Tier.HOST)
    mine, theirs = mm.UnitSize("blocks.0", 1000, 1000), mm.UnitSize("blocks.0", 1000, 1000, stepped=False)
    for c in (2, 4):
        assert mm.state_bytes(theirs, State.PARAMS, up, c) == mm.state_bytes(mine, State.PARAMS, up, c)
        assert mm.state_bytes(theirs, State.GRADS, up, c) == 4000  # its gradients are averaged here as any
        assert mm.state_bytes(theirs, State.OPTIM, up, c) == 0 < mm.state_bytes(mine, State.OPTIM, up, c)
    assert mm.state_bytes(theirs, State.MASTER, up, 2) == 0 < mm.state_bytes(mine, State.MASTER, up, 2)
    nvme = UnitPlacement.all_on(Tier.NVME)
    assert "step" not in mm.unit_jobs(theirs, nvme, 2, False) and "step" in mm.unit_jobs(mine, nvme, 2, False)
    zero2 = mm.UnitSize("blocks.0", 1000, 1000, stepped=False, keeps_grads=False)  # its gradients reduced away
    assert mm.state_bytes(zero2, State.GRADS, up, 2) == 0 and mm.unit_jobs(zero2, nvme, 2, False) == {
        "fetch": {"params": (1000, 2)}}
    assert Placement(stepped_elsewhere=["blocks.0"], grads_elsewhere=True).keeps_grads("blocks.1")
    assert not Placement(stepped_elsewhere=["blocks.0"], grads_elsewhere=True).keeps_grads("blocks.0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_steps_its_own_units_and_takes_the_others_values(tmp_path, dtype):
    """Two engines over the same model and data, one stepping every unit (a replica), one stepping all but
    blocks.1 (a zero1 rank): the second holds no moments (nor, in bf16, master) for blocks.1, leaves it as it was at
    the step, and given the replica's compute copy of it (`write_params`, as the exchange gives a rank its owner's)
    holds what the replica holds, bit for bit, and computes the same loss."""
    torch.manual_seed(0)
    base = tiny_gpt()
    models = {}
    for name, elsewhere in (("replica", []), ("rank", ["blocks.1"])):
        model = tiny_gpt()
        model.load_state_dict(base.state_dict())
        placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / name), stepped_elsewhere=elsewhere)
        models[name] = tightfit.wrap(model, placement, compute_dtype=dtype)
    opts = {name: AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    replica, rank = engine_of(models["replica"]), engine_of(models["rank"])
    theirs = rank.units["blocks.1"]
    assert not theirs.steps_here and rank.units["blocks.0"].steps_here
    entries = {e for tier in theirs.entries().values() for e in tier}
    assert "exp_avg" not in entries and "exp_avg_sq" not in entries and "grads" in entries
    assert ("master" in entries) is False
    assert rank.memory_report()["nvme"]["bytes"] < replica.memory_report()["nvme"]["bytes"]
    before = rank.read_master(theirs)
    for step in range(3):
        for name, model in models.items():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_of(model, *batch(step))
            loss.backward()
            opts[name].clip_grad_norm_(0.5)
            opts[name].step()
            opts[name].zero_grad()
        # blocks.1 was not stepped here: its values are what they were, until its owner's arrive
        assert torch.equal(rank.read_master(theirs), before)
        rank.write_params(theirs, replica.read_params(replica.units["blocks.1"]))  # the exchange's two ends
        before = rank.read_master(theirs)
        for unit in rank.units.values():
            if unit.steps_here:
                assert torch.equal(rank.read_master(unit), replica.read_master(replica.units[unit.name])), unit.name
    with torch.no_grad():
        x, y = batch(9)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            assert torch.equal(loss_of(models["rank"], x, y), loss_of(models["replica"], x, y))
    for m in models.values():
        engine_of(m).close()


def test_a_rank_pools_buffers_for_the_steps_it_runs():
    """The pool holds (depth + 1) blocks' step jobs at most, and no more than the blocks this rank steps: a rank
    stepping one of three blocks preloads no other's master and moments."""
    units = [mm.UnitSize("root", 100, 100)] + [mm.UnitSize(f"blocks.{i}", 1000, 1000, stepped=i == 1)
                                                for i in range(3)]
    p = Placement.everywhere(Tier.NVME, prefetch_depth=2)
    mine = mm.pool_parts(units, p, 4, cuda=False)["optimizer"]
    every = mm.pool_parts([mm.UnitSize(u.name, u.numel, u.trainable) for u in units], p, 4, cuda=False)["optimizer"]
    one_block = mm.job_bytes(mm.unit_jobs(units[2], p.of("blocks.1"), 4, False)["step"], False)
    root = mm.job_bytes(mm.unit_jobs(units[0], p.of("root"), 4, False)["step"], False)
    assert mine == root + one_block and every == root + 3 * one_block


def test_the_heap_is_capped_at_two_arenas_unless_the_user_set_it(monkeypatch):
    from tightfit.utils import malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert malloc_arenas.limit_arenas() is False  # the user's own, read by glibc at start
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert malloc_arenas.limit_arenas() is True  # glibc (Linux): mallopt took it


def test_a_gather_stopped_early_still_receives_what_the_owners_send(monkeypatch):
    """Rank 0's side of a checkpoint's gather: each other owner's unit received once, in the engine's order; closed
    early (the save failed) or dropped before it started, it receives the rest, so no owner is left in its send."""
    from types import SimpleNamespace

    from tightfit.parallel import sharded_optimizer as so

    received = []
    monkeypatch.setattr(so, "_receive", lambda unit, src, with_optim, group: received.append((unit.name, src)) or [])
    monkeypatch.setattr("tightfit.train.checkpoint_swap.unit_groups",
                        lambda engine, unit, with_optim, hand_over: iter([(unit.name, [])]))
    units = [SimpleNamespace(name=n) for n in ("root", "blocks.0", "blocks.1", "blocks.2")]
    engine = SimpleNamespace(units={u.name: u for u in units})
    owned = list(zip(units, (0, 1, 0, 1)))
    assert [name for name, _ in so.Gathered(engine, owned, True, False, None)] == [u.name for u in units]
    assert received == [("blocks.0", 1), ("blocks.2", 1)]
    received.clear()
    gathered = so.Gathered(engine, owned, True, False, None)
    assert next(gathered)[0] == "root" and next(gathered)[0] == "blocks.0"
    gathered.close()  # the save stopped after two units
    assert received == [("blocks.0", 1), ("blocks.2", 1)]
    received.clear()
    so.Gathered(engine, owned, True, False, None)  # never started, dropped
    assert received == [("blocks.0", 1), ("blocks.2", 1)]
