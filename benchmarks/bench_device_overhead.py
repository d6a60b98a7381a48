"""The engine's cost when nothing is offloaded: every state on the device tier against plain PyTorch.

Why: `tightfit train --offload auto` picks this placement whenever the model fits, and then it should cost what
plain PyTorch costs. Measured as process CPU seconds per step (all threads), on one intra-op thread, with the
reference GPT of `make train` (4 x 128, micro-batch 16 x 128, clipping at 1.0 as `tightfit train` does): CPU time,
unlike wall time, hardly moves when other work shares the machine. The two sides alternate in rounds.
A launch-bound shape (`--layers 8 --embd 16 --batch 1 --seq 8`: kernels cost nothing, a step is host time) gives
the engine's own host time against plain PyTorch's ops; `--tier host` that of a model whose every unit streams.

    .venv/bin/python benchmarks/bench_device_overhead.py --steps 30 --rounds 3 [--tier host]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tightfit  # noqa: E402
from tightfit import Placement  # noqa: E402
from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload import engine_of  # noqa: E402


def run(wrapped: bool, steps: int, args) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd))
    if wrapped:
        tightfit.wrap(model, Placement.everywhere(args.tier), device="cpu")
        opt = tightfit.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        t0 = time.process_time()
        loss = model(x, torch.roll(x, -1, 1))
        if wrapped:
            opt.preload_during_backward()
        loss.backward()
        if wrapped:
            opt.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.process_time() - t0)
    if wrapped:
        engine_of(model).close()
    return times[2:]  # the first steps record the schedule and warm the allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tier", default="device", choices=["device", "host"],
                    help="where tightfit's side keeps every state (host: every unit streams)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain, wrapped = [], []
    for _ in range(args.rounds):
        plain += run(False, args.steps, args)
        wrapped += run(True, args.steps, args)
    p, w = statistics.median(plain), statistics.median(wrapped)
    print(f"plain PyTorch   {p * 1e3:7.1f} ms CPU per step (median of {len(plain)})")
    print(f"tightfit {args.tier:6} {w * 1e3:7.1f} ms CPU per step (median of {len(wrapped)})")
    print(f"ratio           {w / p:7.3f}")


if __name__ == "__main__":
    main()
