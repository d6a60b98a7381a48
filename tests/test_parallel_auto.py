"""Unit tests of the scale-out planning pieces that need no process group: every branch of `choose_strategy`,
strategy parsing and its errors, stage balancing, the cost formulas and the `tightfit plan` what-if report."""

from __future__ import annotations

import json

import pytest

from tightfit.config import Config
from tightfit.errors import UsageError
from tightfit.utils.sizes import format_size
from tightfit.parallel import auto
from tightfit.parallel.auto import choose_strategy
from tightfit.parallel.costs import Hardware, ModelProfile, comm_per_step, memory_per_gpu
from tightfit.parallel.mesh import ParallelDims
from tightfit.parallel.pipeline import balance
from tightfit.parallel.plan import ParallelPlan, parse_strategy, plan_from_config
from tightfit.parallel.whatif import what_if

GiB = 2**30


def profile(params_b: float, largest_layer_m: float = 100, layers: int = 32, heads: int = 32) -> ModelProfile:
    """A synthetic model: `params_b` billion parameters, micro-batch 1 x 1024 tokens, bf16."""
    return ModelProfile(n_params=int(params_b * 1e9), largest_layer_params=int(largest_layer_m * 1e6),
                        largest_block_params=int(params_b * 1e9 / layers), n_layers=layers, n_heads=heads,
                        hidden=4096, vocab=32000, seq_len=1024, micro_batch=1)


def hw(gpus=1, nodes=1, mem_gib=80, link="pcie") -> Hardware:
    return Hardware(gpus_per_node=gpus, nnodes=nodes, gpu_mem=mem_gib * GiB, interconnect=link)


SMALL = profile(0.5)  # 8 GB of states: fits in 80 GiB
BIG = profile(13)  # 208 GB of states: does not fit one GPU
HUGE_LAYER = profile(13, largest_layer_m=30_000)  # one 30B-parameter layer: 120 GB with its gradient


@pytest.mark.parametrize("hardware, prof, rule, strategy", [
    (hw(1), SMALL, auto.RULE_SINGLE_FITS, "single"),
    (hw(1), BIG, auto.RULE_SINGLE_OFFLOAD, "offload"),
    (hw(1), HUGE_LAYER, auto.RULE_SINGLE_TILING, "offload+tiling"),
    (hw(8), SMALL, auto.RULE_NODE_FITS, "ddp"),
    (hw(8, link="pcie"), BIG, auto.RULE_NODE_PP, None),
    (hw(8, link="nvlink"), HUGE_LAYER, auto.RULE_NODE_ZERO, "zero3"),
    (hw(8, link="nvswitch"), BIG, auto.RULE_NODE_TP, None),
    (hw(8, 2, link="infiniband"), BIG, auto.RULE_MULTI_FAST_ZERO, None),
    (hw(8, 2, mem_gib=16, link="infiniband"), profile(70, layers=80, heads=64), auto.RULE_MULTI_FAST_3D, None),
    (hw(8, 4, link="ethernet"), profile(70, layers=80, heads=64), auto.RULE_MULTI_SLOW_SHORT, None),
    (hw(8, 2, link="ethernet"), SMALL, auto.RULE_MULTI_SLOW_FITS, "ddp"),
])
def test_every_rule(hardware, prof, rule, strategy, capsys):
    choice = choose_strategy(hardware, prof)
    assert choice.rule == rule
    if strategy:
        assert choice.strategy == strategy
    assert rule in capsys.readouterr().out  # the deciding rule is printed
    if choice.plan is not None:
        assert choice.dims.world_size == hardware.world_size
        # The chosen string round-trips through the --strategy parser to the same mesh.
        again = parse_strategy(choice.strategy, hardware.world_size, tp=choice.dims.tp if choice.dims.tp > 1 else 0,
                               pp=choice.dims.pp if choice.dims.pp > 1 else 0)
        assert again.dims == choice.dims


def test_rule_details():
    pp = choose_strategy(hw(8, link="pcie"), BIG, log=None)
    assert pp.dims.pp > 1 and pp.dims.tp == 1
    tp = choose_strategy(hw(8, link="nvlink"), BIG, log=None)
    assert tp.dims.tp > 1 and tp.dims.pp == 1 and 32 % tp.dims.tp == 0
    z = choose_strategy(hw(8, 2, link="infiniband"), BIG, log=None)
    assert z.strategy in ("zero1", "zero2", "zero3") and z.dims.dp == 16
    slow = choose_strategy(hw(8, 4, link="ethernet"), profile(70, layers=80, heads=64), log=None)
    assert slow.plan.dp_mode == "zero1" and slow.dims.tp == 8 and slow.dims.pp > 1 and slow.dims.dp > 1
    assert slow.strategy == "zero1_pp_tp"
    # ZeRO-3 whose shards still do not fit: states go to host memory (FSDP2 CPUOffloadPolicy).
    off = choose_strategy(hw(2, mem_gib=40, link="nvlink"), profile(30, largest_layer_m=30_000), log=None)
    assert off.plan.cpu_offload and off.notes


def test_parse_strategy():
    assert parse_strategy("ddp", 4).dims == ParallelDims(dp=4)
    assert parse_strategy("tp", 4).dims == ParallelDims(tp=4)
    assert parse_strategy("pp", 2).dims == ParallelDims(pp=2)
    assert parse_strategy("dp_tp", 4).dims == ParallelDims(dp=2, tp=2)
    assert parse_strategy("pp_tp", 8, tp=4).dims == ParallelDims(pp=2, tp=4)
    p = parse_strategy("zero1_pp_tp", 16, tp=4, pp=2)
    assert p.dims == ParallelDims(pp=2, dp=2, tp=4) and p.dp_mode == "zero1" and p.name == "zero1_pp_tp"
    for bad, kw in [("dp_foo", {}), ("zero1_zero2", {}), ("ddp", {"tp": 2}), ("tp", {"tp": 3}),
                    ("pp_tp", {"tp": 2, "pp": 1}), ("dp_tp", {"tp": 4})]:
        with pytest.raises(UsageError):
            parse_strategy(bad, 4, **kw)
    with pytest.raises(UsageError, match="--pp-schedule"):
        ParallelPlan(pp_schedule="zigzag")
    with pytest.raises(UsageError, match="zero3"):
        ParallelPlan(dp_mode="zero2", cpu_offload=True)


def test_plan_from_config_offload():
    cfg = Config()
    cfg.parallel.strategy = "zero3"  # the engine on every rank (params_exchange.py), not FSDP2's CPU offload
    for offload in ("host", "nvme"):
        plan = plan_from_config(cfg.parallel, 4, offload)
        assert plan.engine and not plan.cpu_offload
    assert not plan_from_config(cfg.parallel, 4, "auto").cpu_offload
    cfg.parallel.strategy = "ddp"
    assert plan_from_config(cfg.parallel, 4, "host").engine and plan_from_config(cfg.parallel, 4, "nvme").engine
    assert not plan_from_config(cfg.parallel, 4, "auto").engine
    for stage in ("zero1", "zero2"):  # the engine on every rank, each unit's optimizer states on one
        cfg.parallel.strategy = stage
        plan = plan_from_config(cfg.parallel, 4, "nvme")
        assert plan.engine and plan.dp_mode == stage and plan_from_config(cfg.parallel, 4, "host").engine
    cfg.parallel.strategy, cfg.parallel.tp = "dp_tp", 2  # the engine is for pure data parallelism
    with pytest.raises(UsageError, match="--offload host.*--strategy ddp, zero1, zero2 or zero3"):
        plan_from_config(cfg.parallel, 4, "host")
    cfg.parallel.strategy = "auto"
    with pytest.raises(UsageError, match="auto"):
        plan_from_config(cfg.parallel, 4)


def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert balance([1, 1, 1, 5], 2) == [[0, 1, 2], [3]]  # a heavy last unit (the LM head) gets its own stage
    runs = balance([3, 1, 1, 1, 1, 3], 3)
    assert [i for r in runs for i in r] == list(range(6)) and max(sum([3, 1, 1, 1, 1, 3][i] for i in r)
                                                                for r in runs) == 4
    with pytest.raises(UsageError, match="--pp"):
        balance([1, 1], 3)


def test_memory_shrinks_with_each_zero_stage_and_comm_matches_zero_paper():
    prof = profile(1)
    mem = {m: memory_per_gpu(ParallelPlan(ParallelDims(dp=8), m), prof)["total"] for m in
           ("ddp", "zero1", "zero2", "zero3")}
    assert mem["ddp"] > mem["zero1"] > mem["zero2"] > mem["zero3"]
    psi = prof.n_params * 2  # bf16 bytes
    comm = {m: comm_per_step(ParallelPlan(ParallelDims(dp=8), m), prof)["dp"] for m in ("ddp", "zero2", "zero3")}
    assert comm["ddp"] == pytest.approx(2 * 7 / 8 * psi, rel=1e-6)
    assert comm["zero2"] == pytest.approx(comm["ddp"], rel=1e-6)  # ZeRO-2: same volume as DDP
    assert comm["zero3"] == pytest.approx(1.5 * comm["ddp"], rel=1e-6)  # ZeRO-3: 3 psi vs 2 psi
    # 4 micro-batches a step: ZeRO-2/3 gather and reduce-scatter for each, DDP all-reduces once
    four = {m: comm_per_step(ParallelPlan(ParallelDims(dp=8), m), prof, micro_batches=4)["dp"]
            for m in ("ddp", "zero2", "zero3")}
    assert four == {"ddp": comm["ddp"], "zero2": 4 * comm["zero2"], "zero3": 4 * comm["zero3"]}


def test_a_pipelined_zero_stage_holds_its_parameters_and_gradients_whole():
    """Under `zero2_pp`/`zero3_pp` torch's pipeline schedule keeps each FSDP2 stage gathered, its gradients unsharded,
    until the step's last micro-batch: a stage's whole parameters and gradients count, not 1/dp of them."""
    prof = profile(7)
    plan = ParallelPlan(ParallelDims(pp=2, dp=4), "zero3", pp_microbatches=4)
    m = memory_per_gpu(plan, prof)
    stage = prof.n_params / 2
    assert m["grads"] == int(stage * prof.grad_bytes) and m["gathered"] == int(stage * prof.weight_bytes)
    assert m["weights"] == int(stage * prof.weight_bytes / 4)  # the shards at rest stay 1/dp
    flat = memory_per_gpu(ParallelPlan(ParallelDims(dp=8), "zero3"), prof)
    assert flat["grads"] == int(prof.n_params * prof.grad_bytes / 8)  # without stages: reduce-scattered


def test_what_if_report():
    cfg = Config()
    cfg.parallel.nproc_per_node, cfg.parallel.nnodes, cfg.parallel.interconnect = 8, 2, "nvlink"
    cfg.memory.gpu_mem = "80GiB"
    report = what_if(cfg)
    text = str(report)
    for word in ("strategy:", "mesh:", "memory per GPU", "communication per step", "why:"):
        assert word in text
    d = json.loads(json.dumps(report.to_dict()))
    assert d["mesh"]["pp"] * d["mesh"]["dp"] * d["mesh"]["tp"] == 16
    cfg.parallel.strategy, cfg.parallel.tp = "dp_tp", 8
    d = what_if(cfg).to_dict()
    assert d["mesh"] == {"pp": 1, "dp": 2, "tp": 8} and d["comm_per_step_per_gpu"]["tp"] > 0
    # the collectives' time at the interconnect's assumed bus bandwidth (parallel/links.py)
    assert d["bus_bw_assumed"] == 360e9
    assert d["comm_s_per_step"] == pytest.approx(d["comm_per_step_per_gpu"]["total"] / 360e9)
    cfg.parallel.interconnect = "ethernet"
    slow = what_if(cfg)
    assert slow.comm_s == pytest.approx(36 * d["comm_s_per_step"]) and "assumed for ethernet" in str(slow)
    cfg.parallel.interconnect = "nvlink"
    cfg.memory.gpu_mem = "lots"
    with pytest.raises(UsageError, match="--gpu-mem"):
        what_if(cfg)


def test_what_if_takes_offload_as_the_run_does(monkeypatch):
    """FSDP2's CPU offload (`--strategy auto`'s choice where even ZeRO-3's shards do not fit the GPUs) is split as
    an explicit zero3's (none where recomputation is enough; here, on a GPU too small for any unit, every unit) and
    planned with the host memory it takes per rank and node; `--strategy zero3
    --offload host|nvme` is the offload engine on every rank in a run (parallel/params_exchange.py), which the
    what-if leaves to `tightfit plan`'s per-rank plan, in one line."""
    import tightfit.parallel.whatif as whatif_module
    from tightfit.parallel.plan import ParallelPlan, plan_from_config

    cfg = Config()
    cfg.parallel.nproc_per_node, cfg.parallel.strategy = 8, "zero3"
    cfg.memory.gpu_mem = "80GiB"
    for offload in ("host", "nvme"):
        assert plan_from_config(cfg.parallel, 8, offload).engine
        cfg.memory.offload = offload
        with pytest.raises(UsageError, match="a rank's plan"):
            what_if(cfg)
    cfg.parallel.strategy, cfg.memory.offload = "auto", "auto"
    offloaded = ParallelPlan(ParallelDims(dp=8), "zero3", cpu_offload=True)
    chosen = whatif_module.StrategyChoice("zero3", offloaded.dims, "test", "test", offloaded,
                                          notes=[auto.NOTE_ZERO3_OFFLOAD])
    monkeypatch.setattr(whatif_module, "choose_strategy", lambda *a, **k: chosen)
    # auto's offload is split as zero3's (unit_split.py): where every shard fits with recomputation, none goes
    assert not what_if(cfg).choice.plan.cpu_offload
    cfg.memory.gpu_mem = "1MiB"  # room for no unit's states: every unit offloaded, said once
    report = what_if(cfg)
    d = report.to_dict()
    assert d["cpu_offload"] and d["memory_per_gpu"]["weights"] == d["memory_per_gpu"]["optim"] == 0
    assert [n for n in d["notes"] if "host memory" in n and "ZeRO-3" in n] == [
        n for n in d["notes"] if n.startswith("ZeRO-3's shards need") and "every unit's go to host memory" in n]
    per_node = report.profile.n_params / 8 * 16 * 8
    note = next(n for n in d["notes"] if n.startswith("host memory for the offloaded shards"))
    assert format_size(int(report.profile.n_params / 8 * 16)) in note and format_size(int(per_node)) in note
    # with --nvme the moments (8 of the 16 bytes) go to each rank's swap folder: half the host, the rest on disk
    cfg.memory.nvme = "/tmp/swap"
    chosen.notes.clear()  # the stand-in choice is the same object in both reports
    note = next(n for n in what_if(cfg).to_dict()["notes"] if n.startswith("host memory for the offloaded shards"))
    assert format_size(int(report.profile.n_params / 8 * 8)) in note and "the rest on each rank's NVMe" in note


def _meta_gpt(layers: int, width: int, seq_len: int = 1024):
    import torch

    from tightfit.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=32000, block_size=seq_len, n_layer=layers, n_head=16, n_embd=width))


def test_zero3_given_with_offload_auto_keeps_on_the_gpu_the_units_that_fit_and_sends_the_others_to_the_host():
    """`--strategy zero3 --offload auto`: where ZeRO-3's shards do not fit the GPU with every block recomputed, the
    blocks in forward order and then the root keep their shards, gradients and moments on the GPU while its memory
    holds them (16 bytes a parameter of the rank's shard, after the gathered blocks and the activations), the
    others are offloaded (FSDP2's CPU offload for those units alone); nothing changes where the shards fit, where
    there is no budget, or where checkpointing alone is enough. The what-if says it in one note, as a run does."""
    from dataclasses import replace

    from tightfit.parallel.unit_split import KEPT_BYTES, KEPT_SHARE, host_link_bytes, split_units, zero3_units

    plan = ParallelPlan(ParallelDims(dp=8), "zero3")
    model = _meta_gpt(24, 2048)  # 1.3 B parameters: 2.6 GB of states a rank in 8 shards
    prof = ModelProfile.from_model(model, 1024, 1, True)
    units = zero3_units(model, 8)
    assert [n for n, _ in units] == [f"blocks.{i}" for i in range(24)] + ["root"]
    assert sum(n for _, n in units) == pytest.approx(prof.n_params / 8, rel=1e-3)
    offloaded = memory_per_gpu(replace(plan, cpu_offload=True), replace(prof, checkpointed=True))["total"]
    block = units[0][1] * KEPT_BYTES
    budget = int((offloaded + 10 * block + block // 2) / KEPT_SHARE)  # room for ten blocks' states and a half
    split, why = split_units(plan, model, prof, budget, True)
    assert split.cpu_offload and [n for n, _ in split.kept_on_device] == [f"blocks.{i}" for i in range(10)]
    assert "10 of 25 units keep theirs on the GPU" in why and "host memory" in why
    assert memory_per_gpu(split, replace(prof, checkpointed=True))["total"] <= KEPT_SHARE * budget
    # the offloaded units' fp32 shards up at every all-gather (a block's twice a micro-batch, the root's once), their
    # gradients down each micro-batch: 4 micro-batches
    blocks, root = sum(n for _, n in units[10:24]), units[-1][1]
    assert host_link_bytes(units, split.kept_names, 4) == (16 * (2 * blocks + root), 16 * (blocks + root))
    nothing, why = split_units(plan, model, prof, int(offloaded / KEPT_SHARE), True)  # room for no unit's states
    assert nothing.cpu_offload and not nothing.kept_on_device and "every unit's go to host memory" in why
    everything = memory_per_gpu(plan, replace(prof, checkpointed=True))["total"]
    assert split_units(plan, model, prof, everything, True) == (plan, None)  # the shards fit
    assert split_units(plan, model, prof, None, True) == (plan, None)  # no budget: nothing to decide
    zero2 = ParallelPlan(ParallelDims(dp=8), "zero2")
    assert split_units(zero2, model, prof, budget, True) == (zero2, None)
    # the activations alone over the GPU: recomputing them is the cheaper remedy, unless --checkpointing off
    long = _meta_gpt(4, 1024, seq_len=65536)
    lprof = ModelProfile.from_model(long, 65536, 1, True)
    short_of = memory_per_gpu(plan, lprof)["total"] - 1
    assert split_units(plan, long, lprof, short_of, True)[1] is None
    assert split_units(plan, long, lprof, short_of, False)[0].cpu_offload

    cfg = Config()
    cfg.parallel.nproc_per_node, cfg.parallel.strategy, cfg.memory.gpu_mem = 8, "zero3", "1GiB"
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 24, 2048, 16  # 1.2 B parameters: 2.4 GB a shard
    report = what_if(cfg)
    assert report.choice.plan.cpu_offload and any("ZeRO-3's shards need" in n for n in report.choice.notes)
    assert any("cross each GPU's host link" in n for n in report.choice.notes)
    cfg.memory.gpu_mem = "80GiB"
    assert not what_if(cfg).choice.plan.cpu_offload
