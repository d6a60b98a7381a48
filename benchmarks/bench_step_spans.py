"""A unit's CPU step a span at a time against the whole unit at once ([Note: one pass in cache], step/adamw.py).

Why: on a GPU machine the CPU's step of a large unit makes up to three passes over host memory (the clip multiply,
AdamW, the cast of the new master to the bf16 compute copy); run span by span, the second and third find their
operands in cache. This measures it on the GPU's path on the CPU: device memory kept apart from the host's
(TIGHTFIT_CPU_DEVICE=separate), bf16 compute, every state in host memory, a GPT of 2 blocks of width 2048 (50 M
parameters a block), one micro-batch of 1 x 16 tokens. After `--warmup` steps (the first steps' tiny moments are
subnormal floats, which the CPU runs many times slower), `opt.step()` alternates between spans of
`adamw.SPAN` elements and one span as large as the unit, with the clip binding (a multiply) and not (no multiply).
Prints the median `opt.step()` of each. `--kernels`: the kernels alone, outside the engine (four 2048 x 8192 fp32
parameters, 64 M elements, normal values), whole tensors against spans of 1 M and 256 K elements.

    .venv/bin/python benchmarks/bench_step_spans.py [--steps 8] [--warmup 6] [--kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TIGHTFIT_CPU_DEVICE"] = "separate"

import torch  # noqa: E402

import tightfit  # noqa: E402
from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload.step import adamw  # noqa: E402
from tightfit.optim import AdamW  # noqa: E402


def kernels(reps: int) -> None:
    """The multiply, `_fused_adamw_` and the bf16 cast over whole tensors, then a span at a time."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(2048, 8192)] * 4
    p, g = ([torch.randn(s, generator=gen) for s in shapes] for _ in range(2))
    m, v = ([torch.rand(s, generator=gen) * 0.01 for s in shapes] for _ in range(2))
    cast = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    steps = [torch.tensor(3.0) for _ in shapes]
    coef = torch.tensor(0.999)
    kw = dict(amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)

    def run(span: int | None, clip: bool) -> None:
        for i in range(len(shapes)):
            flat = [t[i].view(-1) for t in (p, g, m, v, cast)]
            n = flat[0].numel()
            for a in range(0, n, span or n):
                b = min(n, a + (span or n))
                pp, gg, mm, vv, cc = (t[a:b] for t in flat)
                if clip:
                    gg.mul_(coef)
                torch._fused_adamw_([pp], [gg], [mm], [vv], [], [steps[i]], **kw)
                cc.copy_(pp)

    kinds = [(span, clip) for clip in (True, False) for span in (None, 1 << 20, 1 << 18)]
    times: dict = {k: [] for k in kinds}
    for rep in range(reps + 1):
        for k in kinds:
            t0 = time.perf_counter()
            run(*k)
            if rep:
                times[k].append(time.perf_counter() - t0)
    for clip in (True, False):
        row = ", ".join(f"{'whole' if s is None else f'spans of {s >> 10} K'} "
                        f"{statistics.median(times[(s, clip)]) * 1e3:.1f} ms" for s in (None, 1 << 20, 1 << 18))
        print(f"kernels, 64 M elements, {'multiply, ' if clip else ''}AdamW, cast: {row}; "
              f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps of each kind")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--kernels", action="store_true", help="the kernels alone, outside the engine")
    args = ap.parse_args()
    if args.kernels:
        kernels(args.steps)
        return
    torch.manual_seed(0)
    model = tightfit.wrap(GPT(GPTConfig(n_layer=2, n_embd=2048, n_head=16, block_size=64, vocab_size=256)),
                          tightfit.Placement.everywhere("host"), compute_dtype=torch.bfloat16, device="cpu")
    opt = AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (1, 16))
    spans = adamw.SPAN
    kinds = [(span, clip) for clip in (1e-3, 1e9) for span in (spans, 1 << 40)]
    times: dict = {k: [] for k in kinds}
    for i in range(args.warmup + args.steps * len(kinds)):
        span, clip = kinds[i % len(kinds)]
        adamw.SPAN = span
        model(x, x).backward()
        opt.clip_grad_norm_(clip)
        t0 = time.perf_counter()
        opt.step()
        if i >= args.warmup:
            times[(span, clip)].append(time.perf_counter() - t0)
        opt.zero_grad()
    adamw.SPAN = spans
    for clip in (1e-3, 1e9):
        whole, cut = (statistics.median(times[(s, clip)]) * 1e3 for s in (1 << 40, spans))
        what = "clip binding (multiply, AdamW, cast)" if clip < 1 else "clip not binding (AdamW, cast)"
        print(f"{what}: whole units {whole:.1f} ms, spans of {spans >> 20} M {cut:.1f} ms ({cut / whole - 1:+.0%}); "
              f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
