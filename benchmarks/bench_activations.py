"""The planner's activation estimate with every block checkpointed, against the memory forward really holds.

Why: the device budget holds the activations beside the engine's buffers, and the engine meters only its own, so
an estimate that is short is memory no meter counts. Measured as RSS right after forward minus right before, with
glibc's mmap threshold at one page (every allocation of a page or more is its own mapping, returned when freed),
at several depths; the slope per layer is what checkpointing keeps per block. The estimate (`costs.act_bytes`)
also holds one block's recomputation and backward's transient, which forward has not reached yet, so compare
slopes, not totals.

    .venv/bin/python benchmarks/bench_activations.py [--wrapped]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrapped", action="store_true", help="through tightfit.wrap (host tier), not plain checkpoint")
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 4096)  # M_MMAP_THRESHOLD: one page
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD

    import psutil
    import torch
    from torch.utils.checkpoint import checkpoint

    import tightfit
    from tightfit import Placement, Tier
    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.planner.costs import act_bytes
    from tightfit.planner.model_profile import profile_model

    torch.set_num_threads(1)
    rows = []
    for layers in (8, 32, 64):
        cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=layers, n_head=args.embd // 64,
                        n_embd=args.embd)
        torch.manual_seed(0)
        model = GPT(cfg)
        ck = [f"blocks.{i}" for i in range(layers)]
        if args.wrapped:
            tightfit.wrap(model, Placement.everywhere(Tier.HOST, checkpoint_units=ck), device="cpu")
        else:
            for block in model.blocks:
                block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(
                    block.forward)
        x = torch.randint(0, 256, (1, args.seq))
        for _ in range(2):  # warm-up: every pool and lazy buffer exists before the measurement
            model(x, x).backward()
            model.zero_grad(set_to_none=True)
        gc.collect()
        before = psutil.Process().memory_info().rss
        loss = model(x, x)
        held = psutil.Process().memory_info().rss - before
        with torch.device("meta"):
            estimate = act_bytes(profile_model(GPT(cfg), 1, args.seq), set(ck))
        rows.append((layers, held, estimate))
        print(f"{layers:3d} layers: forward holds {held / 1e6:6.2f} MB; estimate (with recompute and transient) "
              f"{estimate / 1e6:6.2f} MB")
        loss.backward()
        del loss, model
        gc.collect()
    (l0, h0, e0), (l1, h1, e1) = rows[0], rows[-1]
    print(f"per layer: measured {(h1 - h0) / (l1 - l0) / 1e3:.1f} KB, estimated {(e1 - e0) / (l1 - l0) / 1e3:.1f} KB")


if __name__ == "__main__":
    main()
