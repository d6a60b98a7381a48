"""The gradient worker on a GPU's path: bf16 compute, every state in host memory, gradient accumulation.

Why: on a GPU machine each micro-batch's bf16 gradients come to the host and the gradient worker adds them into
their fp32 sums there ([Note: host passes] in tightfit/planner/costs.py); with accumulation most of those are adds
of a bf16 pack into an fp32 sum, which torch runs at a fraction of memory speed once a parameter outgrows the cache
(tightfit/offload/runtime/widening.py). This runs that path on the CPU: device memory kept apart from the host's
(TIGHTFIT_CPU_DEVICE=separate, as on a GPU: packs, a gradient worker, a step thread), a GPT of 2 blocks of width 2048
(its MLP weights 16.8 M elements, a 1.2 B GPT's), 4 micro-batches of 1 x 16 tokens, clipping. Prints the step,
the gradient worker's wall time (waits for the packs included) and its adds' CPU time on the worker's own thread.
`--accum 1 --early`: one micro-batch a step, no clipping, each unit stepped during backward (the shape of step of
the bench against FSDP2). `--cast-on-device`: the masters uploaded and cast by the device, no compute copy on the
host (`Placement.cast_on_device`); the step's casts then leave the optimizer's time.

    .venv/bin/python benchmarks/bench_gradient_worker.py [--steps 6] [--warmup 2] [--accum 4] [--early]
        [--cast-on-device]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TIGHTFIT_CPU_DEVICE"] = "separate"

import torch  # noqa: E402

import tightfit  # noqa: E402
from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload.step import gradients  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402
from tightfit.optim import AdamW  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--early", action="store_true", help="no clipping; each unit stepped during backward")
    ap.add_argument("--cast-on-device", action="store_true", help="the device casts the uploaded masters")
    args = ap.parse_args()
    adds = [0.0]
    add_into = gradients._add_into

    def timed(*a) -> None:  # the adds' CPU time on the worker's thread
        t = time.thread_time()
        add_into(*a)
        adds[0] += time.thread_time() - t

    gradients._add_into = timed
    torch.manual_seed(0)
    model = tightfit.wrap(GPT(GPTConfig(n_layer=2, n_embd=2048, n_head=16, block_size=64, vocab_size=256)),
                          tightfit.Placement.everywhere("host", cast_on_device=args.cast_on_device),
                          compute_dtype=torch.bfloat16, device="cpu")
    opt = AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (1, 16))
    engine = engine_of(model)

    def step() -> None:
        for i in range(args.accum):
            if i == args.accum - 1:
                opt.step_during_backward() if args.early else opt.preload_during_backward()
            (model(x, x) / args.accum).backward()
        if not args.early:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    engine.timers.clear()
    adds[0] = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    wall = (time.perf_counter() - t0) / args.steps
    timers = engine.timers.snapshot()
    print(f"step {wall * 1e3:.0f} ms; gradient worker {timers.get('grad_accumulate_s', 0) / args.steps * 1e3:.0f} ms "
          f"(wall), its adds {adds[0] / args.steps * 1e3:.0f} ms (CPU); optimizer "
          f"{timers.get('optimizer_s', 0) / args.steps * 1e3:.0f} ms; host tier "
          f"{engine.stores[tightfit.Tier.HOST].bytes / 2**20:.0f} MiB; {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    engine.close()


if __name__ == "__main__":
    main()
