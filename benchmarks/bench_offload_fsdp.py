"""tightfit against FSDP2 (`fully_shard` + `CPUOffloadPolicy`) on one GPU under one memory cap (issue 3, acceptance 6).

    .venv/bin/python benchmarks/bench_offload_fsdp.py --layers 24 --embd 2048 --cap-gib 8 --batch 2 --seq 1024
    .venv/bin/python benchmarks/bench_offload_fsdp.py --device cpu --layers 2 --embd 64 --seq 32 --steps 3  # smoke

The reference GPT (tightfit/models/gpt.py), the same seed, batch and random tokens on both sides; AdamW, no
clipping, bf16 compute with fp32 master weights (`--dtype fp32` for fp32). On a GPU each side runs in its own
process (bench_gpu_util.py), so each has a clean CUDA context, its own cap
(`torch.cuda.set_per_process_memory_fraction`, set before anything is allocated) and its own peaks:
- fsdp2: every block, then the whole model, `fully_shard`-ed on a one-rank process group with
  `CPUOffloadPolicy(pin_memory=True)` (parameters, gradients and optimizer states in host memory; the optimizer
  steps on the CPU over the sharded parameters) and `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.
  Its AdamW is `fused=True`: torch's default for CPU parameters is the single-tensor loop, several times slower
  than the fused CPU kernel tightfit steps with (issue 15, finding 8).
- tightfit: what `tightfit train` does: the planner places every state for the same cap (`--gpu-mem`, the cap
  unless `--gpu-mem-gib` says otherwise) and the machine's RAM (no NVMe), `tightfit.wrap` with that plan,
  `tightfit.optim.AdamW` stepping each unit during backward (no clipping), the plan printed.
- zero3: `tightfit train --strategy zero3` in a world of one: FSDP2 over tightfit's split of the units under the
  same cap (the units that fit keep their states on the GPU, the others FSDP2's CPU offload: parallel/unit_split.py),
  tightfit's `ShardStatesAdamW` (offloaded units stepped on the host as their gradients arrive, kept ones on the GPU),
  bf16 gathers and autocast as the run's; against the engine's step (issue 43: within 10%) and FSDP2's tokens/s.
- tightfit-at-fsdp2-peak (on a GPU, where tightfit reserved more than FSDP2): tightfit again, its `--gpu-mem` set
  to the bytes FSDP2 reserved at its peak.
- tightfit-cpu-casts (with `--compare-casts`, where the plan had the GPU cast the uploaded masters,
  `Placement.cast_on_device`): tightfit again with that choice taken away (its CPU step casts them into host
  compute copies, as before decision 8 of docs/PLANNER.md): the choice's worth measured, not only predicted.
Reported per side: median step time over the steps after `--warmup`, tokens/s, the peaks of CUDA memory allocated
and reserved (the cap bounds reserved bytes), the losses (they agree to bf16 rounding: a check that both train the
same model); then tightfit's tokens/s over FSDP2's, under the cap and at FSDP2's peak. A side that fails (out of
memory under the cap) is reported with its error and the exit status is 1. `--json-out PATH` also writes the
figures there, after each side (a run stopped at a time limit keeps the sides it finished, marked "partial").
Defaults (what `make gpu-check` runs): 24 layers x 2048 (1.2 B parameters), batch 2 x 1024 under an 8 GiB cap.
FSDP2 keeps every block's activations (no checkpointing): about 70 KB per token per block in bf16, 3.4 GB here,
which the earlier defaults (batch 4 under 6 GiB, 6.8 GB) could not have held.
On `--device cpu` both run in this process (in their own with `--isolate`) on the CPU with gloo and no cap: it
checks the code; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu_util as util  # noqa: E402

VOCAB = 256
SIDES = ("fsdp2", "tightfit", "zero3")


def _config(args):
    from tightfit.models.gpt import GPTConfig

    return GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=max(1, args.embd // 128),
                     n_embd=args.embd)


def _batches(args, device):
    import torch

    def batch_of(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        return x.to(device), torch.roll(x, -1, 1).to(device)

    return batch_of


def run_fsdp2(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from tightfit.models.gpt import GPT
    from tightfit.train.memory import param_groups

    device = util.cap_device(args.device, args.cap_gib)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{args.port or _free_port()}")
    try:
        torch.manual_seed(0)
        model = GPT(_config(args))  # host memory; fully_shard moves one block at a time through the GPU
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
              "mesh": init_device_mesh(device.type, (1,))}
        if device.type == "cuda":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        # The same groups as tightfit train's (decay on matrices only) over the sharded, host-resident parameters;
        # fused=True: the CPU kernel (the default for CPU parameters is the single-tensor loop).
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
        util.reset_peaks(device)

        def step(x, y) -> float:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        out = util.timed_steps(device, args.steps, args.warmup, _batches(args, device), step, args.batch * args.seq)
        out["optimizer"] = "torch.optim.AdamW(fused=True) on the CPU"
        return out
    finally:
        dist.destroy_process_group()


def run_tightfit(args) -> dict:
    import torch

    from tightfit.config import Config
    from tightfit.models.gpt import GPT
    from tightfit.train.memory import setup_memory

    device = util.cap_device(args.device, args.cap_gib)
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = args.layers, args.embd, max(1, args.embd // 128)
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = args.batch, args.seq, device.type
    cfg.train.precision = args.dtype
    cfg.optim.grad_clip = 0.0  # as on the FSDP2 side; it lets each unit step during backward
    cfg.optim.lr, cfg.optim.weight_decay = 1e-4, 0.1
    if device.type == "cuda":
        cfg.memory.gpu_mem = f"{args.gpu_mem_gib or args.cap_gib}GiB"
    torch.manual_seed(0)
    model = GPT(_config(args))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from tightfit.planner import search

    offered = search._cpu_casts
    if args.cpu_casts:  # the plan's other choice: masters cast by the CPU's step (docs/PLANNER.md, decision 8)
        search._cpu_casts = lambda *a: False
    try:
        # its loop runs bf16 as given, as FSDP2 does; the engine's side even where its plan would move nothing
        mem = setup_memory(model, cfg, device, dtype, autocast=False, plain_if_still=False)
    finally:
        search._cpu_casts = offered
    print(mem.describe(), file=sys.stderr, flush=True)
    try:
        util.reset_peaks(device)

        from tightfit.offload.step.engine import engine_of

        def step(x, y) -> float:
            loss = mem.model(x, y)
            mem.backward(loss, last=True)
            mem.clip_and_step(0.0)
            return loss.item()

        out = util.timed_steps(device, args.steps, args.warmup, _batches(args, device), step, args.batch * args.seq,
                               timers=engine_of(mem.model).timers)  # the engine's threads over the measured steps
        # The plan's prediction beside this measurement, with the step's terms (the CPU's passes besides AdamW
        # among them: [Note: host passes] in tightfit/planner/costs.py).
        out["plan_vs_measured"] = mem.plan_record(out["median_step_s"])
        out["plan"] = mem.describe()
        out["placement"] = util.placement_of(mem)  # what replay_gpu_plans.py predicts again
        out["engine_peaks"] = mem.peak_memory()
        out["moved_per_step"] = util.moved_per_step(mem.model, args.steps)
        return out
    finally:
        mem.close()


def run_zero3(args) -> dict:
    """`tightfit train --strategy zero3` in a world of one: FSDP2 over tightfit's split of the units under the cap
    (parallel/unit_split.py: the units that fit keep their states on the GPU, the rest FSDP2's CPU offload),
    `ShardStatesAdamW` stepping each offloaded unit on the host during the backward (no clip) and each kept one on
    the GPU, the forward under autocast as the run's (FSDP2 gathers the fp32 shards in bf16, as the fsdp2 side)."""
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from tightfit.models.gpt import GPT
    from tightfit.parallel.costs import ModelProfile
    from tightfit.parallel.mesh import ParallelDims, build_mesh
    from tightfit.parallel.parallelize import make_optimizer, parallelize
    from tightfit.parallel.plan import ParallelPlan
    from tightfit.parallel.unit_split import split_units, zero3_units
    from tightfit.train.trainee import autocast_for

    device = util.cap_device(args.device, args.cap_gib)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{args.port or _free_port()}")
    try:
        torch.manual_seed(0)
        model = GPT(_config(args))
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        plan = ParallelPlan(ParallelDims(dp=1), "zero3")
        prof = ModelProfile.from_model(model, args.seq, args.batch, dtype != torch.float32)
        budget = int((args.gpu_mem_gib or args.cap_gib) * 2**30)
        # every block's activations kept, as on the FSDP2 side
        plan, why = split_units(plan, model, prof, budget, checkpointed=False)
        if not plan.cpu_offload:  # the shards fit: FSDP2 over the GPU alone (a world of one shards nothing else)
            plan = replace(plan, cpu_offload=True, kept_on_device=tuple(zero3_units(model, 1)))
        print(why or "every unit kept on the GPU", file=sys.stderr, flush=True)
        pm = parallelize(model, plan, build_mesh(plan.dims, device), device,
                         param_dtype=dtype if dtype == torch.bfloat16 else None)
        opt = make_optimizer(pm, lr=1e-4, weight_decay=0.1)
        autocast = autocast_for(device, dtype)
        util.reset_peaks(device)

        def step(x, y) -> float:
            opt.step_during_backward()  # no clip: each offloaded unit steps as FSDP2 hands it its gradients
            with autocast():
                loss = pm.module(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        out = util.timed_steps(device, args.steps, args.warmup, _batches(args, device), step, args.batch * args.seq)
        opt.wait()
        out["split"] = why
        out["kept_units"] = [name for name, _ in plan.kept_on_device]
        out["optimizer"] = "ShardStatesAdamW: " + ", ".join(f"{k} {v:.3f}" for k, v in opt.counters().items())
        opt.close()
        return out
    finally:
        dist.destroy_process_group()


def _with(args, **changes):
    """A copy of the parsed arguments with `changes` (a side run in this process with other settings)."""
    return argparse.Namespace(**{**vars(args), **changes})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="GPU memory cap for both sides, GiB")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="tightfit's --gpu-mem (default: the cap)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu (smoke test)")
    ap.add_argument("--json-out", default=None, help="also write the figures to this file")
    ap.add_argument("--isolate", action="store_true", help="each side in its own process on the CPU too "
                    "(always so on a GPU)")
    ap.add_argument("--cpu-casts", action="store_true", help="tightfit's plan without the GPU casting the masters")
    ap.add_argument("--compare-casts", action="store_true", help="also run the tightfit-cpu-casts side (a fourth "
                    "side: `make gpu-check` leaves it out, its stage's limit holds three)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child process
    ap.add_argument("--result", help=argparse.SUPPRESS)  # where the child writes its result
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps <= args.warmup:
        ap.error(f"--steps must be more than --warmup ({args.warmup})")
    return args


def main() -> None:
    args = parse_args()
    run = {"fsdp2": run_fsdp2, "tightfit": run_tightfit, "zero3": run_zero3}
    if args.side:
        util.child_main(args.result, lambda: run[args.side](args))
        return
    shape = ["--layers", args.layers, "--embd", args.embd, "--batch", args.batch, "--seq", args.seq, "--steps",
             args.steps, "--warmup", args.warmup, "--cap-gib", args.cap_gib, "--dtype", args.dtype, "--device",
             args.device] + (["--gpu-mem-gib", args.gpu_mem_gib] if args.gpu_mem_gib else [])
    here = args.device == "cpu" and not args.isolate
    results: dict = {"benchmark": "bench_offload_fsdp", "config": {k: v for k, v in vars(args).items()
                                                                   if k not in ("side", "port", "result", "isolate",
                                                                                "cpu_casts", "compare_casts")}}
    for side in SIDES:
        argv = [str(a) for a in shape] + ["--port", str(_free_port())]
        results[side] = util.run_side(__file__, side, argv, (lambda s=side: run[s](args)) if here else None)
        util.save_partial(args.json_out, results)
    ok = all("error" not in results[s] for s in SIDES)
    if ok:
        results["tokens_per_s_ratio"] = results["tightfit"]["tokens_per_s"] / results["fsdp2"]["tokens_per_s"]
        # tightfit's ZeRO-3 (FSDP2, the split, its optimizer) against its one-process engine and FSDP2's offload
        results["zero3_vs_engine_step"] = results["zero3"]["median_step_s"] / results["tightfit"]["median_step_s"]
        results["zero3_vs_fsdp2_tokens_per_s"] = results["zero3"]["tokens_per_s"] / results["fsdp2"]["tokens_per_s"]
    fsdp_peak = results["fsdp2"].get("peak_cuda_reserved")
    ours = results["tightfit"].get("peak_cuda_reserved", 0)
    if fsdp_peak and not args.gpu_mem_gib and ours > fsdp_peak:
        # tightfit's budget set to what FSDP2 itself reserved: as fast in no more memory?
        gib = fsdp_peak / 2**30
        argv = [str(a) for a in shape] + ["--gpu-mem-gib", f"{gib:.3f}", "--port", str(_free_port())]
        r = results["tightfit-at-fsdp2-peak"] = util.run_side(__file__, "tightfit", argv, None)
        r["gpu_mem_gib"] = gib
        if "tokens_per_s" in r:
            results["tokens_per_s_ratio_at_fsdp2_peak"] = r["tokens_per_s"] / results["fsdp2"]["tokens_per_s"]
        util.save_partial(args.json_out, results)
    if args.compare_casts and (results["tightfit"].get("placement") or {}).get("cast_on_device") and \
            not args.cpu_casts:
        argv = [str(a) for a in shape] + ["--cpu-casts", "--port", str(_free_port())]
        r = results["tightfit-cpu-casts"] = util.run_side(__file__, "tightfit", argv,
                                                          (lambda: run_tightfit(_with(args, cpu_casts=True)))
                                                          if here else None)
        if "tokens_per_s" in r and "tokens_per_s" in results["tightfit"]:
            results["tokens_per_s_ratio_device_casts"] = results["tightfit"]["tokens_per_s"] / r["tokens_per_s"]
    util.write_json(args.json_out, results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
