"""Offload engine behaviour: unit discovery, tier states, the device budget, the schedule, bad input."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

import tightfit
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, hf_gpt2, loss_of, tiny_gpt, train
from tightfit import Placement, Tier, UnitPlacement
from tightfit.errors import UsageError
from tightfit.offload.step.engine import engine_of
from tightfit.offload.step.unit import Where
from tightfit.offload.placement import State
from tightfit.offload.runtime.movers import CpuMover, Transfer
from tightfit.offload.step.units import ALIGN, find_units
from tightfit.optim import AdamW


# ---- units ------------------------------------------------------------------------------------------------------

def test_default_units_are_repeated_blocks_plus_root():
    specs = find_units(tiny_gpt())
    assert [s.name for s in specs] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    root = specs[0]
    assert {s.name for s in root.slots} == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias",
                                            "head.weight"}
    for spec in specs:
        assert all(s.offset % ALIGN == 0 for s in spec.slots)
        ends = sorted((s.offset, s.offset + s.numel) for s in spec.slots)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "no overlap"
        assert spec.numel >= ends[-1][1]


def test_tied_weights_go_to_root_and_explicit_policies():
    model = hf_gpt2()  # lm_head.weight is tok embedding (tied)
    specs = {s.name: s for s in find_units(model)}
    assert set(specs) == {"root", "transformer.h.0", "transformer.h.1"}
    assert any(s.name == "transformer.wte.weight" for s in specs["root"].slots)
    specs = {s.name for s in find_units(tiny_gpt(), ["blocks.*", "head"])}
    assert specs == {"root", "blocks.0", "blocks.1", "blocks.2", "head"}
    specs = {s.name for s in find_units(tiny_gpt(), lambda path, m: isinstance(m, nn.LayerNorm))}
    assert "blocks.0.ln_1" in specs and "ln_f" in specs
    model = tiny_gpt()
    model.head.weight = model.tok_emb.weight  # tie across two explicit units -> root
    specs = {s.name: s for s in find_units(model, ["tok_emb", "head", "blocks.*"])}
    assert "head" not in specs and "tok_emb" not in specs
    assert any(s.name == "tok_emb.weight" for s in specs["root"].slots)


def test_frozen_params_sit_after_the_trainable_prefix():
    model = tiny_gpt()
    model.blocks[0].attn.q_proj.weight.requires_grad_(False)
    spec = next(s for s in find_units(model) if s.name == "blocks.0")
    frozen = [s for s in spec.slots if not s.trainable]
    assert [s.name for s in frozen] == ["blocks.0.attn.q_proj.weight"]
    assert frozen[0].offset >= spec.train_numel
    assert all(s.offset + s.numel <= spec.train_numel for s in spec.slots if s.trainable)


# ---- states and reports ---------------------------------------------------------------------------------------

def test_states_rest_on_their_tiers_between_steps(tmp_path):
    placement = Placement(default=UnitPlacement(Tier.NVME, Tier.HOST, Tier.HOST, Tier.NVME),
                          units={"root": UnitPlacement.all_on(Tier.DEVICE)}, nvme_dir=str(tmp_path))
    _, model, opt = train(tiny_gpt, placement, steps=2)
    engine = engine_of(model)
    block = engine.units["blocks.1"]
    assert block.where == {State.PARAMS: Where.ON_DISK, State.MASTER: Where.IN_HOST, State.GRADS: Where.EMPTY,
                           State.OPTIM: Where.ON_DISK}
    assert block.flat.untyped_storage().nbytes() == 0, "released: no device bytes"
    assert engine.units["root"].resident
    # After a backward (before the step) the gradients rest in host memory.
    x, y = batch(0)
    loss_of(model, x, y).backward()
    engine.wait_grads()
    assert block.where[State.GRADS] == Where.IN_HOST and all(block.has_grad)
    assert all(p.grad is None for p in model.parameters())
    report = engine.memory_report()
    assert report["units"]["blocks.1"]["states"]["optim"] == {"tier": "nvme", "where": "on disk",
                                                              "bytes": 8 * block.spec.train_numel}
    assert report["nvme"]["bytes"] > 0 and report["host"]["tier"] > 0
    opt.step()
    assert block.stepping is not None  # queued: it runs under the next forward, which waits for it
    engine.wait_steps()
    timings = engine.timings()
    for key in ("forward_s", "backward_s", "optimizer_s", "optimizer_wall_s"):
        assert timings[key] > 0
    assert timings["nvme"]["bytes_read"] > 0 and timings["nvme"]["bytes_written"] > 0


def test_schedule_records_forward_and_backward_order():
    _, model, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=2)
    order = engine_of(model).scheduler.order
    assert [u for u in order["forward"]] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [u for u in order["backward"]] == ["blocks.2", "blocks.1", "blocks.0"]


def test_device_budget_is_respected_on_cpu():
    probe = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=1)[1]
    units = engine_of(probe).units
    root, block = units["root"].compute_bytes, units["blocks.0"].compute_bytes
    # Params and autograd's grads of the root and of two blocks (they overlap in backward), and one prefetch.
    budget = 2 * root + 5 * block
    ref = train(tiny_gpt, steps=3)[0]
    losses, model, _ = train(tiny_gpt, Placement.everywhere(Tier.HOST, device_budget=budget, prefetch_depth=4),
                             steps=3)
    assert losses == ref
    engine = engine_of(model)
    engine.wait_grads()  # the last gradients' copies off the device are done: the meter has seen them
    assert engine.device_peak <= budget and engine.device_bytes == 0
    with pytest.raises(UsageError, match="device budget .* too small"):
        tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.HOST, device_budget=2 * root + 4 * block - 1))


def test_smallest_device_budget_holds_with_every_reuse_on(tmp_path):
    """The smallest budget wrap accepts, with the schedule keeping units materialised where it can (the last
    forward units for backward, the root between steps, checkpoint recomputation, a step during backward):
    whatever it keeps is given up before the budget would be exceeded."""
    probe = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=1)[1]
    units = engine_of(probe).units
    budget = 2 * units["root"].compute_bytes + 4 * units["blocks.0"].compute_bytes
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), device_budget=budget,
                                     prefetch_depth=2, checkpoint_units=["blocks.0", "blocks.1", "blocks.2"])
    losses, model, _ = train(tiny_gpt, placement, steps=4, early=True)
    assert losses == train(tiny_gpt, steps=4)[0]
    assert engine_of(model).device_peak <= budget


def _delayed_packs(monkeypatch, gate: "threading.Event | None" = None, delay: float = 0.0) -> None:
    """Make every gradient pack finish late: after `gate` is set, or `delay` seconds after the copy."""
    real = CpuMover.pack_grads

    def pack_grads(self, grads, buf, before=None):
        copied, out = real(self, grads, buf, before), Transfer()
        out.issued.set_result(None)

        def finish() -> None:
            gate.wait() if gate is not None else time.sleep(delay)
            out.done.set_result(copied.done.result())

        threading.Thread(target=finish, daemon=True).start()
        return out

    monkeypatch.setattr(CpuMover, "pack_grads", pack_grads)


def test_gradients_stay_metered_until_copied_off_the_device(tmp_path, monkeypatch):
    """The copy of a unit's gradients into a host buffer runs off the backward thread; until it has read them,
    the `param.grad`s it holds still count against the device budget."""
    gate = threading.Event()
    _delayed_packs(monkeypatch, gate)
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path)))
    engine = engine_of(model)
    x, y = batch(0)
    loss_of(model, x, y).backward()
    every_grad = sum(u.grad_bytes for u in engine.units.values())
    assert engine.device_bytes == every_grad, "released units, gradients not yet packed"
    gate.set()
    engine.wait_grads()
    assert engine.device_bytes == 0


def test_smallest_device_budget_holds_while_gradients_pack_late(tmp_path, monkeypatch):
    """When the budget is full of gradients still being packed, the engine waits for the packs instead of
    exceeding the budget or refusing the unit."""
    probe = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=1)[1]
    units = engine_of(probe).units
    budget = 2 * units["root"].compute_bytes + 4 * units["blocks.0"].compute_bytes
    _delayed_packs(monkeypatch, delay=0.02)
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), device_budget=budget,
                                     prefetch_depth=2)
    losses, model, _ = train(tiny_gpt, placement, steps=3, early=True)
    assert losses == train(tiny_gpt, steps=3)[0]
    assert engine_of(model).device_peak <= budget


def test_eval_without_grad_releases_everything(tmp_path):
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path)))
    with torch.no_grad():
        logits = model(batch(0)[0])
    assert logits.shape == (2, 16, 64)
    engine = engine_of(model)
    assert engine.device_bytes == 0 and all(not u.on_device for u in engine.units.values())


# ---- bad input --------------------------------------------------------------------------------------------------

def test_bad_input_raises_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="expected a tightfit.Placement"):
        tightfit.wrap(tiny_gpt(), "nvme")
    with pytest.raises(UsageError, match="unit 'blocks.9'"):
        tightfit.wrap(tiny_gpt(), Placement(units={"blocks.9": UnitPlacement()}))
    with pytest.raises(UsageError, match="nvme_dir"):
        tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME))
    with pytest.raises(UsageError, match="no module matches"):
        tightfit.wrap(tiny_gpt(), Placement(), units=["layers.*"])
    with pytest.raises(UsageError, match="not part of a wrapped model"):
        AdamW(tiny_gpt().parameters())
    with pytest.raises(UsageError, match="not wrapped"):
        engine_of(tiny_gpt())
    model = tightfit.wrap(tiny_gpt(), Placement())
    with pytest.raises(UsageError, match="already wrapped"):
        tightfit.wrap(model, Placement())



@pytest.mark.parametrize("device_memory", ["separate", "shared"])
def test_step_during_backward_reads_nothing_it_already_holds(tmp_path, monkeypatch, device_memory):
    """fp32, every state on NVMe, optimizer stepping during backward: per steady step each params entry is read
    only where no copy is in memory. blocks.0: first in the next forward, so it keeps its freshly stepped params;
    read once, in backward, and that read is also its step's master. blocks.2: last in forward and first in
    backward, so it stays materialised in between; read once, in forward (its staging buffer, or on a CPU device
    sharing host memory its materialised params, is its step's master). blocks.1: read in forward and in backward.
    The root: read once in forward, its staging buffer its master; on a CPU device sharing host memory never
    (stepped in place, it stays materialised). Moments: read once each. Losses: bitwise those of torch."""
    from collections import Counter

    from tightfit.offload.tiers.stores import DiskStore

    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", device_memory)

    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), prefetch_depth=1)
    torch.manual_seed(0)
    model = tightfit.wrap(tiny_gpt(), placement)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    store = engine_of(model).stores[Tier.NVME]
    assert isinstance(store, DiskStore)
    reads: Counter = Counter()
    load = store.load

    def counting_load(unit, entry, dst, urgent=False):
        reads[(unit, entry)] += 1
        return load(unit, entry, dst, urgent)

    store.load = counting_load
    losses = []
    for step in range(4):
        if step == 3:
            reads.clear()
        loss = loss_of(model, *batch(step))
        opt.step_during_backward()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {u: reads[(u, "params")] for u in ("root", "blocks.0", "blocks.1", "blocks.2")}
    assert params == {"root": 0 if device_memory == "shared" else 1, "blocks.0": 1, "blocks.1": 2, "blocks.2": 1}
    for unit in ("root", "blocks.0", "blocks.1", "blocks.2"):
        assert reads[(unit, "exp_avg")] == reads[(unit, "exp_avg_sq")] == 1
        assert reads[(unit, "grads")] == 0  # final gradients go straight to the step
    expected, _, _ = train(tiny_gpt, steps=4)  # plain PyTorch
    assert losses == expected
    engine_of(model).close()


def test_a_dropped_wrapped_model_is_freed_with_its_engine_threads_and_swap_files(tmp_path):
    """Dropping every reference to a wrapped model (without engine.close()) frees it: the engine does not keep its
    model alive, and the model's finalizer closes the engine (threads stopped, swap files deleted)."""
    import gc
    import threading
    import weakref

    def io_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("tightfit-nvme")}

    before = io_threads()  # other tests' engines may still be alive: only this engine's threads count
    swap = tmp_path / "swap"
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(swap)))
    assert io_threads() - before
    opt = AdamW(model.parameters(), lr=1e-3)
    loss_of(model, *batch(0)).backward()
    opt.step()
    opt.zero_grad()
    assert list(swap.rglob("*.safetensors"))  # in the run's own subfolder (swap_folder.py)
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None, "the wrapped model is still alive"
    assert not list(swap.rglob("*.safetensors")), "its swap files were left behind"
    assert not io_threads() - before, "its I/O threads are still running"


def test_nvme_io_settings_given_to_wrap_reach_the_store(tmp_path):
    # The disk's tuning is the probe's ([Note: disk tuning] in nvme/tuning.py); wrap's `disk` keyword overrides it.
    from tightfit.offload.tiers.nvme.store import DiskTuning

    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"))
    losses, model, _ = train(tiny_gpt, placement, steps=3,
                             wrap_kwargs={"disk": DiskTuning(threads=2, chunk_bytes=8192)})
    assert losses == train(tiny_gpt, steps=3)[0]
    nvme = engine_of(model).stores[Tier.NVME].nvme
    assert nvme.threads == 2 and len(nvme._pool._threads) == 2 and nvme.chunk_bytes == 8192
    engine_of(model).close()


def test_step_after_backward_reads_nothing_once_preloaded(tmp_path):
    """With clipping the steps must wait for backward; `preload_during_backward` loads the master and moments of
    the units the next forward needs first while backward runs ([Note: steps under the next forward]), and keeps the
    final gradients in memory; the step thread loads each other unit's ahead of its step, one unit ahead (the
    placement's prefetch depth). So no unit's step reads its states itself: every load is a preload. Losses:
    bitwise torch's."""
    import threading
    from collections import Counter

    from tightfit.offload.step.optimizer import StepRunner

    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), prefetch_depth=1)
    torch.manual_seed(0)
    model = tightfit.wrap(tiny_gpt(), placement)
    engine = engine_of(model)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    store = engine.stores[Tier.NVME]
    phase = ["backward"]
    local = threading.local()
    reads: Counter = Counter()
    load = store.load
    preload = StepRunner.preload

    def counting_load(unit, entry, dst, urgent=False):
        where = getattr(local, "where", None) or (
            "step" if threading.current_thread().name == "tightfit-step" else phase[0])
        reads[(where, entry)] += 1
        return load(unit, entry, dst, urgent)

    def labelled_preload(self, unit, in_flat=False):
        local.where = "preload during backward" if engine.phase.value == "backward" else "preload ahead of a step"
        try:
            return preload(self, unit, in_flat)
        finally:
            local.where = None

    store.load = counting_load
    StepRunner.preload = labelled_preload
    losses = []
    try:
        for step in range(3):
            phase[0] = "forward"
            loss = loss_of(model, *batch(step))
            opt.preload_during_backward()
            phase[0] = "backward"
            loss.backward()
            phase[0] = "after backward"
            opt.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        engine.wait_steps()
    finally:
        StepRunner.preload = preload
    units = len(engine.units)
    assert not [key for key in reads if key[0] in ("step", "after backward")], reads  # no step loads its own
    assert reads[("backward", "grads")] == 0
    first = 1 + len(engine.scheduler.first("forward"))  # the root, and the next forward's first blocks
    # Moments exist from step 1 on: steps 1 and 2 load them, the first units' during backward, the others ahead.
    assert reads[("preload during backward", "exp_avg")] == reads[("preload during backward", "exp_avg_sq")] == (
        2 * first)
    assert reads[("preload ahead of a step", "exp_avg")] == 2 * (units - first)
    assert losses == train(tiny_gpt, steps=3, clip=0.05)[0]
    engine.close()


def test_a_wrongly_declared_last_micro_batch_changes_nothing(tmp_path):
    """`preload_during_backward` before a micro-batch that is not the last: the gradients held for the step are
    the ones the next micro-batch accumulates onto (the copy on disk is stale), and the result is torch's."""
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"))
    torch.manual_seed(0)
    model = tightfit.wrap(tiny_gpt(), placement)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(3):
        total = 0.0
        for micro in range(3):
            loss = loss_of(model, *batch(step * 3 + micro)) / 3
            opt.preload_during_backward()  # declared for every micro-batch
            loss.backward()
            total += loss.item()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    assert losses == train(tiny_gpt, steps=3, accum=3, clip=0.05)[0]
    engine_of(model).close()


def test_cpu_0_is_the_cpu(tmp_path):
    """`device="cpu:0"` compared unequal to every CPU tensor's device, and took the GPU's branches at random places
    (the first GPU run's README); it is the CPU."""
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.HOST), device="cpu:0")
    engine = engine_of(model)
    assert engine.device == torch.device("cpu") == torch.zeros(1).device
    loss_of(model, *batch(0)).backward()
    engine.close()


PLACEMENTS_FOR_VIEWS = {
    "device": lambda d: Placement.everywhere(Tier.DEVICE),
    "host": lambda d: Placement.everywhere(Tier.HOST),
    "host params, nvme grads": lambda d: Placement(default=UnitPlacement(params=Tier.HOST, master=Tier.HOST,
                                                                         grads=Tier.NVME, optim=Tier.DEVICE),
                                                   nvme_dir=str(d / "swap")),
}


@pytest.mark.parametrize("device_memory", ["separate", "shared"])
@pytest.mark.parametrize("where", sorted(PLACEMENTS_FOR_VIEWS))
def test_views_a_unit_keeps_are_views_of_what_lives_as_long_as_it(tmp_path, monkeypatch, device_memory, where):
    """[Note: views built once] in step/unit.py: after steps with two micro-batches and clipping, every view a unit
    keeps aliases one of its stored entries or its flat buffer, never a buffer granted from the pool (which goes
    back to the pool after its job: a kept view would read it when another job owns it). And the losses are torch's,
    bit for bit, with the kept views doing the step."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", device_memory)
    placement = PLACEMENTS_FOR_VIEWS[where](tmp_path)
    expected, _, _ = train(tiny_gpt, steps=3, accum=2, clip=1.0)
    losses, model, _ = train(tiny_gpt, placement, steps=3, accum=2, clip=1.0)
    assert losses == expected
    engine = engine_of(model)
    kept = 0
    for unit in engine.units.values():
        lasting = {unit.flat_io.untyped_storage()._cdata}
        for state in State:
            for entry in ("params", "master", "grads", "exp_avg", "exp_avg_sq"):
                try:
                    t = unit.store[state].tensor(unit.name, entry)
                except KeyError:
                    continue
                if t is not None:
                    lasting.add(t.untyped_storage()._cdata)
        for views in unit._views.values():
            kept += len(views)
            assert {v.untyped_storage()._cdata for v in views} <= lasting, unit.name
    assert kept >= sum(len(u.trainable) for u in engine.units.values())  # the memory tiers' views were kept
    engine.close()


def _late_device_writes(monkeypatch):
    """(model, engine, optimizer): fp32 params that are their own master on the device tier, stepped on the CPU
    (gradients and moments in host memory), device memory apart from the host's, copies starting up to 50 ms late."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    placement = Placement(default=UnitPlacement(params=Tier.DEVICE, master=Tier.DEVICE, grads=Tier.HOST,
                                                optim=Tier.HOST))
    torch.manual_seed(0)
    model = tiny_gpt()
    tightfit.wrap(model, placement, device="cpu")
    engine = engine_of(model)
    engine.mover.max_delay_s = 0.05
    return model, engine, AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_a_forward_waits_for_the_steps_writes_into_device_memory(monkeypatch):
    """fp32 params that are their own master on the device tier, stepped on the CPU (gradients and moments in host
    memory), device memory apart from the host's: the step writes the new params back into device memory with an
    asynchronous copy. On a GPU the compute stream waits for that copy's event, so the next forward reads the new
    params; the CPU mover keeps that order too ([Note: device writes in stream order] in runtime/movers.py). The
    copies here start up to 50 ms late, so a forward that did not wait would read the old params: the losses
    are torch's, bit for bit."""
    expected, _, _ = train(tiny_gpt, steps=4)
    model, engine, opt = _late_device_writes(monkeypatch)
    assert engine.separate and all(u.master_entry == "params" for u in engine.units.values())
    losses = []
    for step in range(4):
        loss = loss_of(model, *batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine.close()
    assert losses == expected


def test_p_data_after_a_step_reads_the_new_params(monkeypatch):
    """The same write-back as above, read through `p.data` right after `opt.step()` (an alias of the device copy):
    the new values, as a GPU's stream order gives them, though the write-back copy starts up to 50 ms late."""
    _, plain, _ = train(tiny_gpt, steps=1)
    model, engine, opt = _late_device_writes(monkeypatch)
    loss_of(model, *batch(0)).backward()
    opt.step()
    first = dict(model.named_parameters())["blocks.0.attn.q_proj.weight"].data.clone()
    assert torch.equal(first, dict(plain.named_parameters())["blocks.0.attn.q_proj.weight"].data)
    opt.zero_grad()
    engine.close()


def test_the_gradient_worker_times_its_waits_apart_from_its_work(tmp_path):
    """`grad_wait_s`: the gradient worker waiting for a pack's copy off the device (and the unit's earlier
    micro-batch); `grad_accumulate_s`: its adds, norms and writes. One figure for both could not tell a step bound
    by the link from one bound by the host's memory (the H200's Llama with every state on host: 2.66 s a step of
    the worker, against 0.98 s of host passes predicted; batch AF). Copies here finish up to 50 ms late."""
    placement = Placement(default=UnitPlacement(Tier.HOST, Tier.HOST, Tier.NVME, Tier.HOST),
                          units={"root": UnitPlacement.all_on(Tier.DEVICE)}, nvme_dir=str(tmp_path))
    torch.manual_seed(0)
    model = tightfit.wrap(tiny_gpt(), placement)
    engine = engine_of(model)
    assert engine.mover.strict
    engine.mover.max_delay_s = 0.05
    try:
        for i in range(2):
            loss_of(model, *batch(i)).backward()
        engine.wait_grads()
        t = engine.timings()
        assert t["grad_wait_s"] > 0.01 and t["grad_accumulate_s"] > 0
        assert t["grad_wait_s"] > t["grad_accumulate_s"], t
    finally:
        engine.close()
