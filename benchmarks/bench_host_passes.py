"""The CPU's passes over host memory on a GPU machine besides AdamW, each against memory speed ([Note: host passes]).

Why: on a GPU machine whose states live in host memory the CPU does more than AdamW: the gradient worker adds each
micro-batch's bf16 gradient pack into its fp32 sum and takes its norm, the step multiplies the gradients by the clip
coefficient and casts the new master to bf16. The planner prices them (`host_pass_bw`, measured by the probe as the
engine runs them); this prints each one's rate over tensors larger than the caches, with torch's own mixed-dtype
add beside the engine's (`add_widening`, tightfit/offload/runtime/widening.py), and fused AdamW's bytes at its rate.

    .venv/bin/python benchmarks/bench_host_passes.py [--numel 33554432]
"""

from __future__ import annotations

import argparse
import time

import torch

from tightfit.offload.runtime.widening import add_widening
from tightfit.planner.probe import _timeit, measure_adam, measure_host_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=32 << 20, help="elements per tensor (default 32 M: 128 MiB fp32)")
    n = ap.parse_args().numel
    g = torch.Generator().manual_seed(0)
    pack = torch.randn(n, generator=g).to(torch.bfloat16)
    acc, cast = torch.randn(n, generator=g), torch.empty(n, dtype=torch.bfloat16)
    half = torch.tensor(0.5)
    rows = [  # name, what the engine uses it for, bytes moved per element, the call
        ("fp32 += bf16, torch's `add_`", "(before batch V) each later micro-batch's sum", 10, lambda: acc.add_(pack)),
        ("fp32 += bf16, `add_widening`", "each later micro-batch's sum", 10, lambda: add_widening(acc, pack)),
        ("fp32 <- bf16, `copy_`", "a step's first micro-batch", 6, lambda: acc.copy_(pack)),
        ("norm of fp32", "each parameter's gradient norm", 4, lambda: torch._foreach_norm([acc], 2.0)),
        ("fp32 *= scalar", "the clip coefficient", 8, lambda: torch._foreach_mul_([acc], half)),
        ("bf16 <- fp32, `copy_`", "the master's cast to the compute copy", 6, lambda: cast.copy_(acc)),
    ]
    print(f"{n / 2**20:.0f} M elements, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| pass | engine's use | bytes/element | ms | GB/s |")
    print("|---|---|---|---|---|")
    for name, use, nbytes, fn in rows:
        t = _timeit(fn, min_s=0.3)
        print(f"| {name} | {use} | {nbytes} | {t * 1e3:.1f} | {nbytes * n / t / 1e9:.1f} |")
    adam = measure_adam("cpu", n)
    print(f"| fused AdamW | the step | 28 | {n / adam * 1e3:.1f} | {28 * adam / 1e9:.1f} |")
    passes = measure_host_passes(n)
    print(f"probe's host_pass_bw (sum, norm, clip, cast as the engine runs them): {passes / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
