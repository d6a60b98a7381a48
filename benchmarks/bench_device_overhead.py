"""The engine's cost when nothing is offloaded: every state on the device tier against plain PyTorch.

Why: `tightfit train --offload auto` picks this placement whenever the model fits, and then it should cost what
plain PyTorch costs. Measured as process CPU seconds per step (all threads), on one intra-op thread, with the
reference GPT of `make train` (4 x 128, micro-batch 16 x 128, clipping at 1.0 as `tightfit train` does): CPU time,
unlike wall time, hardly moves when other work shares the machine. The two sides alternate in rounds.
A launch-bound shape (`--layers 8 --embd 16 --batch 1 --seq 8`: kernels cost nothing, a step is host time) gives
the engine's own host time against plain PyTorch's ops; `--tier host` that of a model whose every unit streams.

`--wall` measures what `tightfit train --offload auto` against `--offload none` measures (issue 42's bound: 1.02),
without the spread of two processes run minutes apart: wall time, on `tightfit train`'s two intra-op threads, both
models built in one process and trained in alternating blocks of `--steps` steps (the engine's queued steps waited
for at the end of each block, so none runs under the other model's forward); the figure is the median over the
rounds of each round's ratio. It counts what CPU time does not: the engine's threads taking a core from the
compute's, and the interpreter's lock passed between them.

    .venv/bin/python benchmarks/bench_device_overhead.py --steps 30 --rounds 3 [--tier host]
    .venv/bin/python benchmarks/bench_device_overhead.py --wall --steps 15 --rounds 12
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


def build(wrapped: bool, args):
    """The reference GPT of `make train` (or the shape asked for) and its optimizer: plain PyTorch and fused AdamW,
    or wrapped with every state on `args.tier` and tightfit's AdamW."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd))
    if wrapped:
        tightfit.wrap(model, Placement.everywhere(args.tier), device="cpu")
        opt = tightfit.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    return model, opt


def train_steps(model, opt, wrapped: bool, steps: int, g: torch.Generator, args, clock) -> list[float]:
    """`steps` clipped steps as `tightfit train` takes them; `clock()` read around each."""
    times = []
    for _ in range(steps):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        t0 = clock()
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
        times.append(clock() - t0)
    return times


def run(wrapped: bool, steps: int, args) -> list[float]:
    model, opt = build(wrapped, args)
    times = train_steps(model, opt, wrapped, steps, torch.Generator().manual_seed(0), args, time.process_time)
    if wrapped:
        engine_of(model).close()
    return times[2:]  # the first steps record the schedule and warm the allocator


def run_wall(args) -> tuple[list[float], list[float], float]:
    """Per round, the wall seconds per step of a block of plain PyTorch's steps and of a block of tightfit's; and the
    share of tightfit's optimizer time that its forwards waited for (`optimizer_exposed_s` / `optimizer_s`)."""
    sides = {wrapped: (*build(wrapped, args), torch.Generator().manual_seed(0)) for wrapped in (False, True)}

    optimizer = {"optimizer_s": 0.0, "optimizer_exposed_s": 0.0}

    def block(wrapped: bool, steps: int) -> float:
        model, opt, g = sides[wrapped]
        before = engine_of(model).counters() if wrapped else None
        t0 = time.perf_counter()
        train_steps(model, opt, wrapped, steps, g, args, time.perf_counter)
        if wrapped:
            after = engine_of(model).counters()  # the optimizer's time the forwards waited for, not the wait below
            for key in optimizer:
                optimizer[key] += after[key] - before[key]
            engine_of(model).wait_steps()  # its last steps run here, not under plain PyTorch's next forward
        return (time.perf_counter() - t0) / steps

    block(False, 5), block(True, 5)  # the schedule recorded, the allocators warm
    optimizer.update(optimizer_s=0.0, optimizer_exposed_s=0.0)
    plain, wrapped = [], []
    for _ in range(args.rounds):
        plain.append(block(False, args.steps))
        wrapped.append(block(True, args.steps))
    engine_of(sides[True][0]).close()
    return plain, wrapped, optimizer["optimizer_exposed_s"] / max(optimizer["optimizer_s"], 1e-12)


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
    ap.add_argument("--wall", action="store_true",
                    help="wall time on two intra-op threads, the sides in alternating blocks in one process")
    args = ap.parse_args()
    if args.wall:
        torch.set_num_threads(2)  # tightfit train's on the 2-core VM
        plain, wrapped, exposed = run_wall(args)
        ratios = sorted(w / p for p, w in zip(plain, wrapped))
        print(f"plain PyTorch   {statistics.median(plain) * 1e3:7.1f} ms wall per step (median of {len(plain)} "
              f"blocks of {args.steps})")
        print(f"tightfit {args.tier:6} {statistics.median(wrapped) * 1e3:7.1f} ms wall per step; its optimizer "
              f"{exposed:.1%} exposed")
        print(f"ratio           {statistics.median(ratios):7.3f} (median of the rounds' ratios; "
              f"{ratios[0]:.3f}-{ratios[-1]:.3f})")
        return
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
