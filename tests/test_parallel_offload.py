"""Scale-out that keeps the offload: `--strategy ddp --offload host|nvme` runs the offload engine on every rank
(tightfit/parallel/replicas.py), each rank's states on its own tiers, the gradients averaged as they leave the device.

The reference is one process of plain PyTorch + AdamW (`--offload none`) seeing the same sequences: the run's one
data position deals each step's global batch to the ranks (TokenDataset.step_batches), so 2 ranks with
`--grad-accum A` see what one process with `--grad-accum 2A` sees (before it, each rank drew from a generator of its
own, and no one-process run saw what a group saw). Losses agree within 1e-6 relative over 10 clipped
steps (the sums are added in another order, and averaged over ranks after each rank's division by A).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from parallel_launch import ROOT, free_port, rank_env

STEPS = 10


def _train(tiny_args, out, *extra: str, ranks: int = 1, env: dict | None = None
           ) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
    args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(out) for a in tiny_args]
    launch = ["--nproc-per-node", str(ranks), "--master-port", str(free_port())] if ranks > 1 else []
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", str(STEPS),
                           "--log-interval", "1", "--eval-interval", str(STEPS), *launch, *extra],
                          env=rank_env(**(env or {})), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in _metrics(out) if r["kind"] == "train"}  # full precision
    assert len(losses) == STEPS, proc.stdout[-2000:]
    return proc, losses


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory) -> dict[int, float]:
    """The reference of every test here: one process of plain PyTorch + AdamW, `--grad-accum 4` (tiny_args' run)."""
    from conftest import TINY

    out = tmp_path_factory.mktemp("plain") / "run"
    return _train(["--data", str(corpus), "--out-dir", str(out), *TINY], out, "--grad-accum", "4", "--offload",
                  "none")[1]


def _close(a: dict[int, float], b: dict[int, float], rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= rel * abs(b[k]), (k, a[k], b[k])


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("tier,order", [pytest.param("host", "micro", marks=pytest.mark.slow),
                                        pytest.param("nvme", "unit", marks=pytest.mark.slow)])
def test_the_engine_on_every_rank_trains_as_one_process(tiny_args, tmp_path, tier, order, plain):
    """2 ranks, each with the whole model through its engine (every state on host, or on NVMe in a swap folder of its
    own), clipped at 1.0: the losses of one process of plain PyTorch on the same sequences; the gradients cross the
    group once per micro-batch in micro-batch-major order, once a step in unit-major order; the checkpoint is rank
    0's in the one-process format (one process resumes it); the ranks' swap folders are gone at the end."""
    one = plain
    swap = tmp_path / "swap"
    extra = ["--nvme", str(swap)] if tier == "nvme" else []
    proc, two = _train(tiny_args, tmp_path / "two", "--grad-accum", "2", "--strategy", "ddp", "--offload", tier,
                       "--accumulation", order, *extra, ranks=2)
    _close(two, one)
    assert "the offload engine on each" in proc.stdout
    parameters = int(re.search(r"training ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    steps = [r for r in _metrics(tmp_path / "two") if r["kind"] == "train"]
    # rank 0's averages per step: every fp32 gradient once per micro-batch (2), or once
    assert steps[-1]["engine"]["allreduce_bytes"] == 4 * parameters * (2 if order == "micro" else 1)
    engine = steps[-1]["engine"]
    if tier == "nvme":
        assert engine["nvme_write_bytes"] > 0
        assert str(swap / "rank-00000") in proc.stdout  # rank 0's plan names its own folder
        assert swap.is_dir() and not any(swap.iterdir()), list(swap.iterdir())  # each rank removed its own
    plan = next(r for r in _metrics(tmp_path / "two") if r["kind"] == "plan_vs_measured")
    assert len(plan["ranks"]) == 2
    # the group's all-reduce measured before planning, and priced in the step (links.py)
    assert plan["step_terms"]["allreduce_bus_bw"] > 0 and plan["step_terms"]["allreduce_s"] > 0
    assert "bus bandwidth (measured in this run's group)" in proc.stdout
    for rank in plan["ranks"]:  # each rank's process within 10% of its own plan's
        rss = rank["rss_peak"]
        assert abs(rss["measured"] - rss["predicted"]) <= 0.10 * rss["predicted"], plan["ranks"]
    if tier != "nvme":
        return
    resumed = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args[:tiny_args.index("--out-dir")],
                              "--out-dir", str(tmp_path / "two"), *tiny_args[tiny_args.index("--out-dir") + 2:],
                              "--steps", str(STEPS + 2), "--grad-accum", "4", "--resume"],
                             env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from" in resumed.stdout and f"step {STEPS + 2}/{STEPS + 2}" in resumed.stdout


@pytest.mark.parametrize("strategy,tier,order", [pytest.param("zero1", "nvme", "micro", marks=pytest.mark.slow),
                                                 pytest.param("zero2", "host", "unit", marks=pytest.mark.slow),
                                                 pytest.param("zero2", "nvme", "micro", marks=pytest.mark.slow),
                                                 ("zero3", "nvme", "unit"),
                                                 pytest.param("zero3", "host", "micro", marks=pytest.mark.slow)])
def test_zero1_zero2_zero3_with_the_engine_shard_the_states(tiny_args, tmp_path, plain, strategy, tier, order):
    """2 ranks, `--strategy zero1|zero2|zero3`, every state on each rank's host memory or NVMe, clipped at 1.0: the
    losses of one process of plain PyTorch on the same sequences (as the replicas'); each rank steps its own units and
    holds their master and moments (zero2: and gradients; zero3: and parameters) alone, so the two ranks together
    hold less than two replicas' (16 bytes a parameter each), as each rank's plan said; each unit's new values cross
    once a step (4 bytes a parameter), or under zero3 its params for each use (the root's forward, each block's
    forward and backward, per pass); the checkpoint, gathered to rank 0, is the one-process format (one process
    resumes it)."""
    swap = tmp_path / "swap"
    extra = ["--nvme", str(swap)] if tier == "nvme" else []
    if strategy == "zero3":  # 2 held-out batches to one rank, 1 to the other: every rank still runs 2 forwards
        extra += ["--eval-batches", "3", "--zero3-params", "exchange"]  # under --offload host the plan could choose
    proc, two = _train(tiny_args, tmp_path / "two", "--grad-accum", "2", "--strategy", strategy, "--offload", tier,
                       "--accumulation", order, *extra, ranks=2)
    _close(two, plain)
    assert f"strategy {strategy}, the offload engine on each" in proc.stdout
    parameters = int(re.search(r"training ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    engine = [r for r in _metrics(tmp_path / "two") if r["kind"] == "train"][-1]["engine"]
    if strategy == "zero3":  # each pass: every parameter in forward, all but the root's again in backward
        passes = 2 if order == "micro" else 1
        assert 4 * parameters * passes < engine["exchange_bytes"] < 8 * parameters * passes, engine
    else:
        assert engine["exchange_bytes"] == 4 * parameters
    plan = next(r for r in _metrics(tmp_path / "two") if r["kind"] == "plan_vs_measured")
    held = [rank["nvme_peak" if tier == "nvme" else "host_peak"] for rank in plan["ranks"]]
    # the disk holds what the plan said; host memory at most that (the staging pool's share of it as it was used)
    assert all(d["measured"] == d["predicted"] if tier == "nvme" else d["measured"] <= d["predicted"] for d in held)
    replica = 16 * parameters  # fp32 params (their own master), gradients and two moments
    # 4 + 4 + 8 / 2 of 16 bytes (zero1), 4 + (4 + 8) / 2 (zero2), (4 + 4 + 8) / 2 (zero3); the host tier's staging
    # and the exchange's buffers on top
    share = {"zero1": 0.8, "zero2": 0.65 if tier == "nvme" else 0.8, "zero3": 0.55 if tier == "nvme" else 0.8}[strategy]
    assert sum(d["measured"] for d in held) < share * 2 * replica, (held, replica)
    for rank in plan["ranks"]:
        rss = rank["rss_peak"]
        assert abs(rss["measured"] - rss["predicted"]) <= 0.10 * rss["predicted"], plan["ranks"]
    assert tier != "nvme" or swap.is_dir() and not any(swap.iterdir()), list(swap.iterdir())
    resumed = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args[:tiny_args.index("--out-dir")],
                              "--out-dir", str(tmp_path / "two"), *tiny_args[tiny_args.index("--out-dir") + 2:],
                              "--steps", str(STEPS + 2), "--grad-accum", "4", "--offload", "none", "--resume"],
                             env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"step {STEPS + 2}/{STEPS + 2}" in resumed.stdout


def test_zero3_on_fsdp2_keeps_the_units_that_fit_on_the_device_and_offloads_the_rest(tiny_args, tmp_path, plain):
    """2 ranks, `--strategy zero3` with `--offload auto` and a device budget (`--gpu-mem`, the CPU device's as in one
    process) that ZeRO-3's shards exceed by more than a block: FSDP2 keeps the first block's shards, gradients and
    moments on the device, stepped there, and offloads the other block and the root (parallel/unit_split.py), whose
    moments go to each rank's swap folder past its `--cpu-mem`; the losses of one process of plain PyTorch within
    1e-6, the progress line and metrics.jsonl with the moments' disk bytes, the swap folders gone at the end."""
    from tightfit.config import Config
    from tightfit.parallel.costs import ModelProfile, memory_per_gpu
    from tightfit.parallel.mesh import ParallelDims
    from tightfit.parallel.plan import ParallelPlan
    from tightfit.parallel.unit_split import KEPT_BYTES, KEPT_SHARE, zero3_units
    from tightfit.train.loop import build_meta_model

    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.train.seq_len, cfg.train.micro_batch = 2, 32, 2, 32, 4
    model = build_meta_model(cfg)  # the blocks and activations are tiny_args' (the root's vocabulary aside)
    offloaded = ParallelPlan(ParallelDims(dp=2), "zero3", cpu_offload=True)
    fixed = memory_per_gpu(offloaded, ModelProfile.from_model(model, 32, 4, False))["total"]
    budget = int((fixed + KEPT_BYTES * zero3_units(model, 2)[0][1] + 64) / KEPT_SHARE)  # one block's and no more
    swap = tmp_path / "swap"
    proc, two = _train(tiny_args, tmp_path / "two", "--grad-accum", "2", "--strategy", "zero3", "--gpu-mem",
                       f"{budget}B", "--nvme", str(swap), "--cpu-mem", "1KiB", ranks=2)
    _close(two, plain)
    assert "1 of 3 units keep theirs on the GPU" in proc.stdout, proc.stdout[-2000:]
    assert "1 of 3 units on the device, 0 of 3 units in host memory, 2 (" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"\| disk [0-9.]+ GB/s \|", proc.stdout), proc.stdout[-2000:]
    engine = [r for r in _metrics(tmp_path / "two") if r["kind"] == "train"][-1]["engine"]
    assert engine["nvme_write_bytes"] > 0 and engine["optimizer_s"] > 0, engine
    assert swap.is_dir() and not any(swap.iterdir()), list(swap.iterdir())


def test_zero3_params_fsdp2_runs_fsdp2s_zero3_under_offload_host(tiny_args, tmp_path, plain):
    """2 ranks, `--strategy zero3 --offload host --zero3-params fsdp2`: FSDP2's ZeRO-3 with every unit's shards in host
    memory and ShardStatesAdamW (no engine: no exchange bytes), trained as one process of plain PyTorch within 1e-6
    ([Note: two ZeRO-3s with the offload])."""
    proc, fsdp2 = _train(tiny_args, tmp_path / "fsdp2", "--grad-accum", "2", "--strategy", "zero3", "--offload", "host",
                         "--zero3-params", "fsdp2", ranks=2)
    _close(fsdp2, plain)
    assert "tightfit: ZeRO-3 with --offload: FSDP2's (each rank's shards in its host memory" in proc.stdout
    assert "AdamW's moments" not in proc.stdout  # no --nvme: every unit's moments in host memory
    engine = [r for r in _metrics(tmp_path / "fsdp2") if r["kind"] == "train"][-1]["engine"]
    assert "exchange_bytes" not in engine and engine["optimizer_s"] > 0, engine


@pytest.mark.slow
def test_zero3_with_offload_host_runs_the_path_its_plan_predicts_faster(tiny_args, tmp_path, plain):
    """2 ranks, `--strategy zero3 --offload host`: the run prices both paths, says which runs and why, runs that one
    (the exchange's bytes in its counters or not), and trains as one process of plain PyTorch within 1e-6."""
    from tightfit.parallel.zero3_path import FSDP2_BY

    proc, auto = _train(tiny_args, tmp_path / "auto", "--grad-accum", "2", "--strategy", "zero3", "--offload", "host",
                        ranks=2)
    _close(auto, plain)
    said = re.search(r"tightfit: ZeRO-3 with --offload: (FSDP2's|the offload engine's exchange) .*: predicted step: "
                     r"FSDP2's all-gathers ([0-9,]+) ms, the exchange ([0-9,]+) ms", proc.stdout)
    assert said, proc.stdout[-3000:]
    fsdp2_ms, exchange_ms = (float(g.replace(",", "")) for g in said.groups()[1:])
    if abs(fsdp2_ms - FSDP2_BY * exchange_ms) > 1.0:  # the line's whole milliseconds decide away from the edge
        assert (said.group(1) == "FSDP2's") == (fsdp2_ms <= FSDP2_BY * exchange_ms)
    ran_exchange = "exchange_bytes" in [r for r in _metrics(tmp_path / "auto") if r["kind"] == "train"][-1]["engine"]
    assert ran_exchange == (said.group(1) != "FSDP2's")


@pytest.mark.slow
def test_four_ranks_with_the_engine_train_as_one_process(tiny_args, tmp_path, plain):
    """4 ranks, each with every state on its own NVMe folder, against one process with 4x the micro-batches."""
    one = plain
    _, four = _train(tiny_args, tmp_path / "four", "--grad-accum", "1", "--strategy", "ddp", "--offload", "nvme",
                     "--nvme", str(tmp_path / "swap"), ranks=4)
    _close(four, one)


@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_a_sharded_run_exports_one_hugging_face_folder(tiny_args, tmp_path, llama_folder, strategy):
    """`--export-hf` from 2 zero2 or zero3 ranks, every state on NVMe: rank 0 writes one folder from its own units'
    values (read as tensors, not as the copy of its swap files a checkpoint makes of an fp32 unit on NVMe) and the
    others' sent to it; it loads in transformers and holds the trained weights, the run's last checkpoint's bit for
    bit."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tightfit.train.checkpoint import read_all

    export = tmp_path / "export"
    _train(tiny_args, tmp_path / "two", "--model", f"hf:{llama_folder}", "--grad-accum", "2", "--strategy",
           strategy, "--offload", "nvme", "--nvme", str(tmp_path / "swap"), "--export-hf", str(export), ranks=2)
    saved = read_all(tmp_path / "two")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), saved[f"model.{name}"]), name
    first = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    assert not torch.equal(first.model.layers[1].mlp.up_proj.weight, loaded.model.layers[1].mlp.up_proj.weight)


@pytest.mark.slow
def test_zero2_on_the_gpu_shaped_device_trains_as_the_replicas(tiny_args, tmp_path):
    """The GPU's code path on the CPU (`TIGHTFIT_CPU_DEVICE=separate`: device memory apart, page-locked host tier,
    gradients shipped off the device), bf16, 2 ranks: zero2's losses are the replicas' to the last bit."""
    flags = ["--n-layer", "4", "--grad-accum", "2", "--offload", "host", "--precision", "bf16", "--accumulation",
             "micro"]
    gpu = {"TIGHTFIT_CPU_DEVICE": "separate"}
    _, replicas = _train(tiny_args, tmp_path / "ddp", *flags, "--strategy", "ddp", ranks=2, env=gpu)
    _, zero2 = _train(tiny_args, tmp_path / "zero2", *flags, "--strategy", "zero2", ranks=2, env=gpu)
    assert zero2 == replicas


@pytest.mark.slow
def test_four_ranks_of_ddp_zero2_and_zero3_with_the_offload_train_as_one_process(tiny_args, tmp_path):
    """4 ranks (a model of 4 blocks: 5 units for 4 owners), clipped: ddp, zero2 and zero3 with every state on each
    rank's host, zero3 on each rank's NVMe, and zero3 on FSDP2 with every shard in host memory, against one process of
    plain PyTorch with 4x the micro-batches: losses within 1e-6; the engine's zero2 and zero3 to the last bit of its
    replicas' (the sums, the norms and the steps are the same ops on the same bits); each engine rank's RSS within 10%
    of its plan; the NVMe run's swap in a folder per rank, each holding what its plan said, removed at the end."""
    four = ["--n-layer", "4", "--grad-accum", "1"]
    _, plain = _train(tiny_args, tmp_path / "plain", "--n-layer", "4", "--grad-accum", "4", "--offload", "none")
    swap = tmp_path / "swap"
    runs = {"ddp": ["--strategy", "ddp", "--offload", "host"], "zero2": ["--strategy", "zero2", "--offload", "host"],
            "zero3": ["--strategy", "zero3", "--offload", "host", "--zero3-params", "exchange"],
            "zero3-nvme": ["--strategy", "zero3", "--offload", "nvme", "--nvme", str(swap)],
            "zero3-fsdp2": ["--strategy", "zero3", "--offload", "host", "--zero3-params", "fsdp2"]}
    losses = {}
    for name, flags in runs.items():
        _, losses[name] = _train(tiny_args, tmp_path / name, *four, *flags, ranks=4)
        _close(losses[name], plain)
        if name == "zero3-fsdp2":
            continue
        plan = next(r for r in _metrics(tmp_path / name) if r["kind"] == "plan_vs_measured")
        assert len(plan["ranks"]) == 4
        for rank in plan["ranks"]:
            rss = rank["rss_peak"]
            assert abs(rss["measured"] - rss["predicted"]) <= 0.10 * rss["predicted"], (name, plan["ranks"])
            if name == "zero3-nvme":  # each rank's swap folder held its own units' states, as planned
                assert rank["nvme_peak"]["measured"] == rank["nvme_peak"]["predicted"] > 0, plan["ranks"]
    assert all(losses[name] == losses["ddp"] for name in ("zero2", "zero3", "zero3-nvme"))
    assert swap.is_dir() and not any(swap.iterdir()), list(swap.iterdir())


def test_small_gradients_are_averaged_in_buckets_large_ones_alone():
    """One all-reduce per bucket (DDP's 25 MiB), not per gradient: each call is a round of messages."""
    import torch

    from tightfit.parallel.replicas import BUCKET_BYTES, buckets

    big = torch.zeros(BUCKET_BYTES // 4)
    grads = [torch.zeros(10), torch.zeros(6), big, torch.zeros(5), torch.zeros(5, dtype=torch.bfloat16),
             torch.zeros(BUCKET_BYTES // 4 - 4), torch.zeros(8)]
    got = buckets(grads)
    assert [[id(g) for g in b] for b in got] == [[id(grads[0]), id(grads[1])], [id(big)], [id(grads[3])],
                                                  [id(grads[4])], [id(grads[5])], [id(grads[6])]]
    assert sum(len(b) for b in got) == len(grads)  # every gradient once, in order


def _resumed_across(tiny_args, tmp_path, first: tuple[int, list[str]], then: tuple[int, list[str]],
                    ref: dict[int, float]) -> None:
    """Stop a run of `first` (ranks, flags) at step 4, resume it with `then`: steps 5-10 are `ref`'s within 1e-6 (the
    data position is the run's, the state the one-process format)."""
    out = tmp_path / "moved"
    _train_to(tiny_args, out, first[0], [*first[1], "--stop-at", "4"], steps=4)
    _, moved = _train(tiny_args, out, *then[1], "--resume", ranks=then[0])
    _close({k: v for k, v in moved.items() if k > 4}, {k: v for k, v in ref.items() if k > 4})


def _train_to(tiny_args, out, ranks: int, extra: list[str], steps: int) -> None:
    args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(out) for a in tiny_args]
    launch = ["--nproc-per-node", str(ranks), "--master-port", str(free_port())] if ranks > 1 else []
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", str(STEPS),
                           "--log-interval", "1", *launch, *extra], env=rank_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--stop-at {steps} reached" in proc.stdout


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param(
    "zero1", marks=pytest.mark.slow), "zero3"])
def test_one_process_checkpoint_resumes_on_two_ranks_with_the_engine(tiny_args, tmp_path, plain, strategy):
    """1 -> 2: one process (every state on host, 4 micro-batches) stopped at step 4, resumed by 2 ranks each with its
    engine on NVMe (2 micro-batches each; with zero1 each rank reads the moments of its own units alone, with zero3
    also the params): the losses of one uninterrupted plain run."""
    _resumed_across(tiny_args, tmp_path, (1, ["--grad-accum", "4", "--offload", "host"]),
                    (2, ["--grad-accum", "2", "--strategy", strategy, "--offload", "nvme", "--nvme",
                         str(tmp_path / "swap")]), plain)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_four_and_on_one(tiny_args, tmp_path, plain):
    """2 -> 4 (plain DDP) and 2 -> 1 (the engine in one process), from DDP and from zero1 with the engine; 2 -> 4
    from zero3 onto the engine's replicas (the model's 3 units are too few for 4 zero3 ranks: 1 -> 2 onto zero3 is
    in `make test`)."""
    two = (2, ["--grad-accum", "2", "--strategy", "ddp"])
    _resumed_across(tiny_args, tmp_path / "a", two, (4, ["--grad-accum", "1", "--strategy", "ddp"]), plain)
    _resumed_across(tiny_args, tmp_path / "b", two, (1, ["--grad-accum", "4", "--offload", "host"]), plain)
    zero1 = (2, ["--grad-accum", "2", "--strategy", "zero1", "--offload", "host"])
    _resumed_across(tiny_args, tmp_path / "c", zero1, (1, ["--grad-accum", "4", "--offload", "host"]), plain)
    zero3 = (2, ["--grad-accum", "2", "--strategy", "zero3", "--offload", "nvme", "--nvme", str(tmp_path / "s2")])
    _resumed_across(tiny_args, tmp_path / "d", zero3, (4, ["--grad-accum", "1", "--strategy", "ddp", "--offload",
                                                          "nvme", "--nvme", str(tmp_path / "s4")]), plain)


def test_the_plan_of_every_rank(tmp_path, capsys):
    """`tightfit plan --nproc-per-node 2 --strategy ddp --offload nvme`: one rank's plan, made for its half of the
    host's memory and of the swap disk, and the bytes the gradients' average sends, which the step does not count."""
    from tightfit.cli import main
    from tightfit.utils.sizes import parse_size

    common = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "32", "--micro-batch", "2",
              "--grad-accum", "3", "--nvme", f"{tmp_path}:8GiB", "--cpu-mem", "2GiB"]
    assert main(["plan", *common, "--nproc-per-node", "2", "--strategy", "ddp", "--offload", "nvme", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ranks = got["ranks"]
    assert ranks["ranks"] == 2 and ranks["engine"]
    assert parse_size(ranks["cpu_mem_per_rank"]) == 2 << 30  # --cpu-mem is a rank's own
    assert ranks["nvme_per_rank"] == f"{tmp_path}:{4 << 30}B"  # the disk is shared: half each
    import torch

    from tightfit.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2,
                                                          n_embd=64)).parameters())
    times = 1 if ranks["order"] == "unit" else 3
    assert ranks["allreduce_bytes_per_step"] == parameters * 4 * times  # fp32 on a CPU
    assert ranks["sent_bytes_per_step_per_rank"] == ranks["allreduce_bytes_per_step"]  # 2(n-1)/n = 1 for n = 2
    assert main(["plan", *common, "--nproc-per-node", "2", "--strategy", "ddp", "--offload", "nvme"]) == 0
    text = capsys.readouterr().out
    assert "2 ranks, strategy ddp, the offload engine on each" in text and "ms added to the predicted step" in text
    # zero2: rank 0's plan holds only its own units' master, moments and gradients; the ranks' shares add up to the
    # model's; the reduce sends half a ring all-reduce's bytes, the exchange every parameter's fp32 value once
    assert main(["plan", *common, "--nproc-per-node", "2", "--strategy", "zero2", "--offload", "nvme", "--json"]) == 0
    zero2 = json.loads(capsys.readouterr().out)
    shares = zero2["ranks"]["stepped_parameters_per_rank"]
    assert sum(shares) == parameters and min(shares) > 0
    assert zero2["ranks"]["sent_bytes_per_step_per_rank"] == zero2["ranks"]["allreduce_bytes_per_step"] // 2
    assert zero2["ranks"]["exchange_bytes_per_step"] == parameters * 4
    assert zero2["placement"]["grads_elsewhere"] and zero2["placement"]["stepped_elsewhere"]
    assert zero2["prediction"]["peak"]["nvme"] < got["prediction"]["peak"]["nvme"]
    # zero3: rank 0 holds the params of its own units alone too, and each use's params are broadcast
    assert main(["plan", *common, "--nproc-per-node", "2", "--strategy", "zero3", "--offload", "nvme", "--json"]) == 0
    zero3 = json.loads(capsys.readouterr().out)
    assert zero3["placement"]["exchanged"] and zero3["prediction"]["peak"]["nvme"] < zero2["prediction"]["peak"]["nvme"]
    assert zero3["ranks"]["exchange_bytes_per_step"] > zero2["ranks"]["exchange_bytes_per_step"]
    assert main(["plan", *common, "--nproc-per-node", "2", "--strategy", "zero3", "--offload", "nvme"]) == 0
    text = capsys.readouterr().out
    assert "holds their parameters, master, moments and gradients alone" in text
    assert "each use's parameters broadcast by their rank beside the compute" in text


def test_zero3_broadcasts_on_a_gpu_cross_the_link_through_the_device(tmp_path, capsys):
    """On NCCL each use's parameters go up from the owner's exchange buffer and come down into every rank's before
    the use's fetch uploads them: those copies are in the GPU plan's traffic; on PCIe the broadcasts share the lanes
    of the copies and the average, so phase A holds them (the compute hides them on NVLink)."""
    from tightfit.cli import main

    common = ["--n-layer", "4", "--n-embd", "1024", "--n-head", "8", "--seq-len", "64", "--micro-batch", "1",
              "--hardware", "h200", "--gpu-mem", "2GiB", "--cpu-mem", "8GiB", "--nproc-per-node", "4"]
    got = {}
    for strategy, link in (("zero2", "pcie"), ("zero3", "pcie"), ("zero3", "nvlink")):
        assert main(["plan", *common, "--strategy", strategy, "--offload", "host", "--interconnect", link,
                     "--json"]) == 0
        got[strategy, link] = json.loads(capsys.readouterr().out)
    z2, z3, nv = got["zero2", "pcie"], got["zero3", "pcie"], got["zero3", "nvlink"]
    sent = z3["ranks"]["exchange_bytes_per_step"]
    assert sent > 0
    assert z3["prediction"]["traffic"]["d2h"] >= z2["prediction"]["traffic"]["d2h"] + sent * 3 / 4  # the others'
    for plan in (z2, z3):  # the wire: the largest unit either sends, on the device for the whole run
        wire = plan["prediction"]["breakdown"]["device"]["exchange wire"]
        assert wire == max(u["numel"] for u in plan["profile"]["units"]) * 2, plan["prediction"]["breakdown"]["device"]
    p = z3["prediction"]
    bus = z3["ranks"]["allreduce_bus_bw"]
    assert p["exchange_s"] > 0 and p["phase_a_s"] >= p["copy_s"] + sent / bus  # the link's stream holds them
    assert nv["prediction"]["exchange_s"] < p["exchange_s"] and nv["prediction"]["step_s"] < p["step_s"]


def test_gloo_averages_go_through_a_kept_flat_buffer():
    """On gloo a unit's gradients are averaged through one flat buffer of the averager's own, kept and reused (a
    coalesced gloo call flattens into a new buffer each time, and those left the heap 90-100 MiB fuller at a 13 M
    model's peak: benchmarks/RESULTS.md batch AK), with the coalesced call's results bit for bit. Under zero2 the
    same buffer reduces a unit's gradients to its owner alone, and a clip's norms are summed over the ranks, each
    counted once."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(ROOT / "tests" / "averager_worker.py")], env=rank_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["flat"] and got["mean"] and got["bitwise_as_coalesced"] and got["shapes"], got
    assert got["kept"] == 1 and got["reused"], got  # one buffer, the second call's too
    assert got["bytes"] == 3 * (64 * 48 + 48 + 3 * 5 * 7) * 4, got  # two averages and a reduce
    assert got["reduced_to_owner"], got  # zero2: the owner has the mean, bit for bit; the other's untouched
    assert got["norms"] == [3.0, 4.0, 5.0], got  # each rank's own norms summed, a unit every rank holds once



def test_a_gpu_rank_compares_its_device_peak_with_the_strategys_prediction(monkeypatch):
    """`tightfit train --strategy zero3` on GPUs: each rank's allocated peak beside what `costs.memory_per_gpu`
    predicted for it (the figure the split and the checkpointing were decided by), in the run's closing lines and
    metrics.jsonl; nothing on a CPU rank, which has no device apart from its host."""
    import torch

    from tightfit.parallel.trainee import Sharded

    rank = Sharded.__new__(Sharded)
    rank.world = type("World", (), {"rank": 1})()
    rank.predicted_device, rank.device = 1000 * 2**20, torch.device("cpu")
    assert rank.compare_with_plan(0.5) is None and rank.plan_record(0.5, 0.6) is None
    rank.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 800 * 2**20)
    assert rank.compare_with_plan(0.5) == "plan (rank 1): device peak 1000.0 MiB predicted, 800.0 MiB measured (+25%)"
    record = rank.plan_record(0.5, 0.6)
    assert record["predicted"]["device_peak"] == 1000 * 2**20 and record["measured"]["device_peak"] == 800 * 2**20
