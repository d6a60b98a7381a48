"""Where a launch-bound training step's time goes, part by part, against what the planner's probe measures.

    PYTHONPATH=. python benchmarks/bench_step_parts.py [--device cuda] [--json-out FILE]

Why: the default `tightfit train` (a GPT of 4 blocks of width 128, 16 x 128 tokens, bf16 under autocast) is bound
by the host issuing its kernels on a GPU, and its step there was 38% slower than the plan predicted (19.1 ms
against 11.9 on the H200 of 2026-11-27b). The plan's host time is three figures of the probe: a cost per traced op
(timed on a chain of tiny fp32 multiplies and adds), a cost per unit and one per step (the engine on a tiny fp32
GPT). This times, on the same device and in one process:

- the probe's figures as it measures them, and the same measurements under autocast to bf16;
- the cost per op of a transformer's own op mix: a tiny GPT's forward and backward without the engine, at 2 and 6
  blocks, against the traced ops of each (the slope is seconds per op), fp32 and under autocast;
- the default model's step as `tightfit train` runs it, plain PyTorch and the engine, split into the batch (sample
  and copy to the device), the forward, the backward and clip + step + zero_grad, each phase ended by a device
  sync; and the whole step with the loop's one sync;
- the kernels one step launches (torch.profiler, on CUDA) against the ops the plan traced, and the share of the
  step the GPU is busy;
- with `--llama-layers N`, the same parts of the GPU check's Llama (TinyLlama's shape, N of its blocks, 2 x 2048),
  plain and planned for `--llama-cap-gib`: run 4's plan for 24 GiB took 202 ms a step where plain PyTorch took
  113 and the plan predicted 125.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_util import _sync


def _median_s(fn, device: torch.device, reps: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _autocast(device: torch.device, dtype: torch.dtype):
    return (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext


def _traced_ops(model_fn, micro_batch: int, seq_len: int, dtype: torch.dtype, cuda: bool) -> dict:
    from tightfit.planner.model_profile import DTYPE_NAMES, profile_model

    with torch.device("meta"):
        model = model_fn()
    prof = profile_model(model, micro_batch, seq_len, DTYPE_NAMES[dtype], cuda=cuda)
    return {"fwd": sum(u.fwd.n_ops for u in prof.units), "bwd": sum(u.bwd.n_ops for u in prof.units),
            "units": len(prof.units)}


def tiny_gpt_op_cost(device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """Seconds per traced op of a tiny GPT's forward + backward (no engine, no optimizer): the slope between 2 and
    6 blocks, so the loss's and embedding's fixed ops drop out."""
    from tightfit.models.gpt import GPT, GPTConfig

    def make(n):
        return lambda: GPT(GPTConfig(n_layer=n, n_embd=16, n_head=2, block_size=8, vocab_size=64))

    out = {}
    for n in (2, 6):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = make(n)().to(device)
        x = torch.zeros(1, 8, dtype=torch.long, device=device)
        cast = _autocast(device, dtype)

        def step(model=model, x=x, cast=cast):
            with cast():
                loss = model(x, x)
            loss.backward()

        ops = _traced_ops(make(n), 1, 8, dtype, device.type == "cuda")
        out[n] = {"step_s": _median_s(step, device, reps), "ops": ops["fwd"] + ops["bwd"]}
    out["s_per_op"] = (out[6]["step_s"] - out[2]["step_s"]) / max(1, out[6]["ops"] - out[2]["ops"])
    return out


def chain_op_cost(device: torch.device, dtype: torch.dtype) -> float:
    """The probe's per-op figure (`measure_op_overhead`), in fp32 or under autocast."""
    from tightfit.planner.probe import measure_op_overhead

    return measure_op_overhead(device.type, dtype)


def default_step_parts(device: torch.device, dtype: torch.dtype, offload: str, reps: int) -> dict:
    """The default run's step, `tightfit train`'s way (its model, 16 x 128 byte tokens)."""
    from tightfit.models.build import build_model

    cfg = _config(device, dtype, offload)
    model = build_model(cfg.model, 256, cfg.train.seq_len, device=torch.device("cpu"))
    return step_parts(model, cfg, device, dtype, 256, reps)


def llama_step_parts(device: torch.device, dtype: torch.dtype, offload: str, reps: int, layers: int,
                     cap_gib: float | None) -> dict:
    """The GPU check's 1.1B Llama (TinyLlama's shape, `layers` of its 22 blocks), 2 x 2048 tokens, planned for
    `cap_gib` (tightfit's --gpu-mem; offload "none": plain PyTorch)."""
    import bench_gpu_llama

    args = bench_gpu_llama.parse_args(["--layers", str(layers)])
    model = bench_gpu_llama.build_model(args)[0]
    cfg = _config(device, dtype, offload)
    cfg.train.micro_batch, cfg.train.seq_len = args.batch, args.seq
    cfg.optim.grad_clip = 0.0
    if cap_gib and offload != "none":
        cfg.memory.gpu_mem = f"{cap_gib}GiB"
    return step_parts(model, cfg, device, dtype, args.vocab, reps)


def _config(device: torch.device, dtype: torch.dtype, offload: str):
    from tightfit.config import Config
    from tightfit.planner.model_profile import DTYPE_NAMES

    cfg = Config()
    cfg.train.device = device.type
    cfg.memory.offload = offload
    cfg.train.precision = DTYPE_NAMES[dtype]
    return cfg


def step_parts(model, cfg, device: torch.device, dtype: torch.dtype, vocab: int, reps: int) -> dict:
    """A training step as `tightfit train` runs it, timed by phase (each ended by a device sync: the batch, the
    forward, the backward, clip + step + zero_grad) and whole (the loop's one sync); on CUDA with the kernels it
    launches and the share of its time the GPU is busy (kernels' time over the step's: near 1, the GPU bounds the
    step; well under it, the host does, or waits on the GPU between its issues)."""
    from tightfit.models.build import model_loss
    from tightfit.train.data import TokenDataset, data_generator
    from tightfit.train.memory import setup_memory

    t = cfg.train
    mem = setup_memory(model, cfg, device, dtype)
    try:
        tokens = np.random.default_rng(0).integers(0, vocab, 1 << 20, dtype=np.int32 if vocab > 256 else np.uint8)
        data = TokenDataset.from_tokens(tokens, t.seq_len, 0.1, vocab)
        gen = data_generator(t.seed)
        cast = _autocast(device, dtype)

        def batch():  # the loop's sampler, and its copies to the device
            x, y = data.sample(t.micro_batch, gen)
            return x.to(device), y.to(device)

        phases = {"batch": [], "forward": [], "backward": [], "clip_step_zero": []}

        def parted():
            t0 = time.perf_counter()
            x, y = batch()
            _sync(device)
            t1 = time.perf_counter()
            with cast():
                loss = model_loss(mem.model, x, y)
            _sync(device)
            t2 = time.perf_counter()
            mem.backward(loss, last=True)
            _sync(device)
            t3 = time.perf_counter()
            mem.clip_and_step(cfg.optim.grad_clip)
            loss.item()
            t4 = time.perf_counter()
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(v)

        def whole():  # as the loop: the loss summed on the device, read back once
            total = torch.zeros((), device=device)
            x, y = batch()
            with cast():
                loss = model_loss(mem.model, x, y)
            mem.backward(loss, last=True)
            total += loss.detach()
            mem.clip_and_step(cfg.optim.grad_clip)
            total.item()

        whole_s = _median_s(whole, device, reps, warm=3)
        for _ in range(reps):
            parted()
        out = {"whole_step_s": whole_s, **{k: statistics.median(v) for k, v in phases.items()}}
        if device.type == "cuda":
            out["kernels_per_step"] = _kernels(whole)
        plan = getattr(mem, "plan", None)
        if plan is not None:
            pred = plan.prediction
            out.update(predicted_step_s=pred.step_s, predicted_compute_s=pred.compute_s,
                       predicted_host_s=pred.host_s, plan=plan.summary())
        return out
    finally:
        mem.close()


def _kernels(step) -> dict:
    """Kernel launches (and copies, memsets) of one step, the aten ops the host dispatched for it, and the seconds
    the GPU ran kernels in it (under the profiler, whose own cost lengthens the step)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.events()
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                "cuLaunchKernelEx", "cudaMemcpyAsync", "cudaMemsetAsync")]
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1e6
    return {"device_events": len(device_events), "launch_calls": len(launches),
            "aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "device_busy_s": busy, "profiled_step_s": wall, "busy_share": busy / wall if wall else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--llama-layers", type=int, default=0, help="also the GPU check's Llama with this many of its "
                    "22 blocks, plain and planned (0: not)")
    ap.add_argument("--llama-cap-gib", type=float, default=24.0, help="the Llama plan's --gpu-mem")
    ap.add_argument("--only-llama", action="store_true", help="the Llama's steps alone")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bf16 = torch.bfloat16
    from tightfit.config import Config
    from tightfit.models.build import build_model
    from tightfit.planner.probe import measure_engine_overhead

    cfg = Config()
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__}
    if not args.only_llama:
        # The default model's steps first, in a process that has run nothing else: in run 5 (batch AF), measured
        # after the probes below, the engine's step took 16.7 ms where `tightfit train`'s took 10.5.
        for offload in ("none", "auto"):
            out[f"default_{offload}"] = default_step_parts(device, bf16, offload, args.reps)
            print(offload, json.dumps(out[f"default_{offload}"]), file=sys.stderr, flush=True)
        out["chain_s_per_op"] = {"fp32": chain_op_cost(device, torch.float32),
                                 "bf16_autocast": chain_op_cost(device, bf16)}
        out["tiny_gpt"] = {"fp32": tiny_gpt_op_cost(device, torch.float32, args.reps),
                           "bf16_autocast": tiny_gpt_op_cost(device, bf16, args.reps)}
        out["engine_probe"] = {}
        for name, dtype in (("fp32", torch.float32), ("bf16_autocast", bf16)):
            unit, step = measure_engine_overhead(device.type, dtype=dtype)
            out["engine_probe"][name] = {"unit_s": unit, "step_s": step}
        default = lambda: build_model(cfg.model, 256, cfg.train.seq_len, device=torch.device("meta"))
        out["default_traced_ops"] = _traced_ops(default, cfg.train.micro_batch, cfg.train.seq_len, bf16,
                                                device.type == "cuda")
        out["default_auto_again"] = default_step_parts(device, bf16, "auto", args.reps)
    if args.llama_layers:
        for offload in ("none", "auto"):
            key = f"llama{args.llama_layers}_{offload}"
            out[key] = llama_step_parts(device, bf16, offload, max(2, args.reps // 10), args.llama_layers,
                                        args.llama_cap_gib)
            print(key, json.dumps(out[key]), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
