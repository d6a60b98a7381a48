"""tightfit against FSDP2 (`fully_shard` + `CPUOffloadPolicy`) on one GPU under one memory cap (issue 3, acceptance 6).

    .venv/bin/python benchmarks/bench_offload_fsdp.py --layers 24 --embd 2048 --cap-gib 6 --batch 4 --seq 1024
    .venv/bin/python benchmarks/bench_offload_fsdp.py --device cpu --layers 2 --embd 64 --steps 3   # smoke test

The reference GPT (tightfit/models/gpt.py), the same seed, batch and random tokens on both sides; AdamW, no
clipping, bf16 compute with fp32 master weights (`--dtype fp32` for fp32). Each side runs in its own process, so
each has a clean CUDA context, its own cap (`torch.cuda.set_per_process_memory_fraction`, set before anything is
allocated) and its own peak:
- fsdp2: every block, then the whole model, `fully_shard`-ed on a one-rank process group with
  `CPUOffloadPolicy(pin_memory=True)` (parameters, gradients and optimizer states in host memory; the optimizer
  steps on the CPU over the sharded parameters) and `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.
- tightfit: what `tightfit train` does: the planner places every state for the same cap (`--gpu-mem`) and the
  machine's RAM (no NVMe), `tightfit.wrap` with that plan, `tightfit.optim.AdamW` stepping each unit during
  backward (no clipping), the plan printed.
Reported: median step time over the steps after `--warmup`, tokens/s, peak CUDA memory allocated, the losses
(they agree to bf16 rounding: a check that both train the same model), and tightfit's tokens/s over FSDP2's.
On `--device cpu` both run on the CPU with gloo and no cap: it checks the script runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402

VOCAB = 256


def _config(args) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=max(1, args.embd // 128),
                     n_embd=args.embd)


def _batch(args, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    return x.to(device), torch.roll(x, -1, 1).to(device)


def _device(args) -> torch.device:
    """The side's device, made current and capped (before anything is allocated on it)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(args, device, step_fn) -> dict:
    times, losses = [], []
    for step in range(args.steps):
        x, y = _batch(args, step, device)
        _sync(device)
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        print(f"  step {step}: loss {loss:.4f}  {times[-1]:.3f} s", file=sys.stderr, flush=True)
    measured = times[args.warmup:]
    step_s = statistics.median(measured)
    out = {"step_s": times, "median_step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s,
           "losses": losses}
    if device.type == "cuda":
        out["peak_cuda_allocated"] = torch.cuda.max_memory_allocated(device)
    return out


def run_fsdp2(args) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = _device(args)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    torch.manual_seed(0)
    model = GPT(_config(args))  # host memory; fully_shard moves one block at a time through the GPU
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
    if device.type == "cuda":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    from torch.distributed.device_mesh import init_device_mesh

    kw["mesh"] = init_device_mesh(device.type, (1,))
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    from tightfit.train.memory import param_groups

    # The same groups as tightfit train's (decay on matrices only) over the sharded, host-resident parameters.
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step(x, y) -> float:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    out = _train(args, device, step)
    dist.destroy_process_group()
    return out


def run_tightfit(args) -> dict:
    from tightfit.config import Config
    from tightfit.train.memory import setup_memory

    device = _device(args)
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = args.layers, args.embd, max(1, args.embd // 128)
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = args.batch, args.seq, device.type
    cfg.train.precision = args.dtype
    cfg.optim.grad_clip = 0.0  # as on the FSDP2 side; it lets each unit step during backward
    cfg.optim.lr, cfg.optim.weight_decay = 1e-4, 0.1
    if device.type == "cuda":
        cfg.memory.gpu_mem = f"{args.cap_gib}GiB"
    torch.manual_seed(0)
    model = GPT(_config(args))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    mem = setup_memory(model, cfg, device, dtype)
    print(mem.describe(), file=sys.stderr, flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step(x, y) -> float:
        loss = mem.model(x, y)
        mem.backward(loss, last=True)
        mem.clip_and_step(0.0)
        return loss.item()

    out = _train(args, device, step)
    out["plan"] = mem.describe()
    mem.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--cap-gib", type=float, default=6.0, help="GPU memory cap for both sides, GiB")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--side", choices=["fsdp2", "tightfit"], help=argparse.SUPPRESS)  # one side, in a child
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit(f"bench_offload_fsdp.py: --steps must be more than --warmup ({args.warmup})")
    if args.side:
        out = run_fsdp2(args) if args.side == "fsdp2" else run_tightfit(args)
        print(json.dumps(out))
        return
    results = {}
    for side in ("fsdp2", "tightfit"):
        print(f"{side}:", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--side", side, "--port", str(_free_port())] + sys.argv[1:]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            sys.exit(f"bench_offload_fsdp.py: the {side} side failed (exit {proc.returncode}); its output is above")
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    results["tokens_per_s_ratio"] = results["tightfit"]["tokens_per_s"] / results["fsdp2"]["tokens_per_s"]
    results["config"] = {k: v for k, v in vars(args).items() if k not in ("side", "port")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
