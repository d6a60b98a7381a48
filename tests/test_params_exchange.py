"""ZeRO-3 over the offload engine ([Note: parameters sent for each use] in tightfit/parallel/params_exchange.py): a
unit's params held by its owner alone and sent to every rank for each use. The placement and memory model of it
here; two ranks of the engine against plain PyTorch (tests/params_exchange_worker.py); the CLI's runs in
test_parallel_offload.py."""

from __future__ import annotations

import sys

import pytest

from parallel_launch import ROOT, start_ranks
from tightfit import Placement, Tier
from tightfit.offload import memory_model as mm
from tightfit.offload.placement import State, UnitPlacement


def test_a_placement_names_the_exchanged_units_their_groups_and_tiles():
    p = Placement(stepped_elsewhere=["blocks.1"], exchanged=["root", "blocks.0", "blocks.1"])
    assert p.is_exchanged("blocks.1.mlp.fc.tiles.0") and not p.is_exchanged("lm_head.tiles.0")
    assert p.holds_params("blocks.0") and p.holds_params("root") and not p.holds_params("blocks.1")
    assert not p.holds_params("blocks.1.mlp.fc.tiles.0")  # a tile of another rank's block
    assert p.holds_params("lm_head.tiles.0")  # no rank owns it alone: every rank holds it
    assert Placement(stepped_elsewhere=["blocks.1"]).holds_params("blocks.1")  # zero1/zero2 keep every param
    grouped = p.for_groups({"blocks.0-1": ["blocks.0", "blocks.1"]})
    assert grouped.exchanged == ["blocks.0-1", "root"]
    assert Placement.from_json(p.to_json()).exchanged == ["root", "blocks.0", "blocks.1"]
    tiled = p.for_units(["root", "blocks.0", "blocks.1.fc.tiles.0", "blocks.1.fc.tiles.1"])
    assert tiled.exchanged == ["root", "blocks.0", "blocks.1.fc.tiles.0", "blocks.1.fc.tiles.1"]


def test_another_ranks_unit_holds_nothing_and_streams_through_the_exchange():
    """The memory model of a ZeRO-3 rank: another rank's unit has no state bytes at all and is streamed for each
    use even where the placement's params tier is the device; an exchanged unit of its own keeps its params but no
    fetch staging (the exchange reads them); the exchange's buffers are host memory in every phase."""
    nvme = UnitPlacement.all_on(Tier.NVME)
    theirs = mm.UnitSize("blocks.1", 1000, 1000, stepped=False, keeps_grads=False, holds_params=False,
                         exchanged=True)
    mine = mm.UnitSize("blocks.0", 1000, 1000, exchanged=True)
    for s in State:
        assert mm.state_bytes(theirs, s, nvme, 2) == 0
    assert mm.state_bytes(mine, State.PARAMS, nvme, 2) == 2000
    assert mm.unit_jobs(theirs, nvme, 2, False) == {}
    assert "fetch" not in mm.unit_jobs(mine, nvme, 2, False)
    assert "fetch" in mm.unit_jobs(mm.UnitSize("blocks.0", 1000, 1000), nvme, 2, False)
    on_device = Placement.everywhere(Tier.DEVICE)
    assert mm.streams(theirs, on_device) and not mm.streams(mine, on_device)
    units = [mm.UnitSize("root", 500, 500, exchanged=True), mine, theirs]
    # the blocks' buffers, each the largest block's, and the root's one
    assert mm.exchange_buffer_bytes(units, 2) == mm.EXCHANGE_SLOTS * 2000 + 1000
    memory = mm.step_memory(units, Placement.everywhere(Tier.HOST), 2, cuda=False)
    for phase in mm.PHASES:
        assert memory.phases[phase]["host"]["exchange"] == mm.EXCHANGE_SLOTS * 2000 + 1000
    plain = [mm.UnitSize("root", 500, 500), mm.UnitSize("blocks.0", 1000, 1000)]
    assert "exchange" not in mm.step_memory(plain, Placement.everywhere(Tier.HOST), 2, cuda=False).phases["step"]["host"]
    # on a device apart (NCCL's device tensors, or the CPU standing in for a GPU) one wire of the largest unit sent
    for phase in mm.PHASES:
        assert mm.step_memory(units, Placement.everywhere(Tier.HOST), 2, cuda=True).phases[phase]["device"][
            "exchange wire"] == 2000
    assert "exchange wire" not in memory.phases["forward"]["device"]  # gloo from host memory: none
    zero1 = [mm.UnitSize("root", 1500, 1500, stepped=False), mm.UnitSize("blocks.0", 1000, 1000)]
    assert mm.exchange_wire_bytes(zero1, 2) == 3000 and mm.exchange_wire_bytes(plain, 2) == 0


@pytest.mark.parametrize("tier,env", [("nvme", {}), ("host", {"TIGHTFIT_CPU_DEVICE": "separate"})])
def test_two_ranks_send_each_use_and_train_as_plain_pytorch(tmp_path, monkeypatch, tier, env):
    """2 gloo ranks of the engine with ZeRO-3, clipped, the blocks called in an order that changes every other step
    and a no-grad evaluation in yet another order between steps (the strict mover's late copies and the exchange's
    late arrivals on): the mean loss of plain PyTorch on the global batch within 1e-5 each step, another rank's units
    holding no state, and every use of a unit one exchange (when the order is not the one recorded, what was asked
    for ahead is dropped on both ranks alike and each use asks for its own: no rank waits for a broadcast the other
    does not make)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    procs, logs = start_ranks([sys.executable, str(ROOT / "tests" / "params_exchange_worker.py"), tier,
                               str(tmp_path / "swap"), "8"], tmp_path)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=120))
        except Exception:  # noqa: BLE001 - a hang is the failure this test looks for
            p.kill()
            codes.append("hung")
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in out)
    for rank, text in enumerate(out):
        assert f"[rank {rank}] OK" in text, text[-2000:]
