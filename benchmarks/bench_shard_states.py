"""FSDP2 ZeRO-3's optimizer: torch's fused AdamW after the backward against ShardStatesAdamW (each unit's moments in
host memory or the rank's swap files, stepped under the next forward), on the same FSDP2 shards, side by side.

Why: with FSDP2's CPU offload (what `--strategy auto` picks where even ZeRO-3's shards do not fit the GPUs) torch's
AdamW steps the whole model on the host after the backward while the GPU waits; tightfit/parallel/shard_states.py
queues each unit and the next forward waits only for the unit it reaches. Run under torchrun, every rank builds the
three optimizers over three copies of one model and trains them in alternating blocks of `--steps` clipped steps;
rank 0 prints each side's median wall seconds a step, the ratio to torch's, and the share of the optimizer's time
the forwards waited for (`optimizer_exposed_s / optimizer_s`). `--clip 0`: no clip, and tightfit's units step during
the backward as their gradients arrive.

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/bench_shard_states.py --layers 8 --embd 384 --steps 5 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload.placement import Tier  # noqa: E402
from tightfit.offload.tiers.stores import DiskStore, MemoryStore  # noqa: E402
from tightfit.parallel.data_parallel import apply_zero  # noqa: E402
from tightfit.parallel.mesh import init_distributed, leave_process  # noqa: E402
from tightfit.parallel.shard_states import ShardStatesAdamW, fsdp_units  # noqa: E402


def build(args, mesh):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    return apply_zero(GPT(cfg), mesh, 3)


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clip", type=float, default=1.0, help="0: no clip, tightfit's units step during the backward")
    args = ap.parse_args()
    env = init_distributed()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (env.world_size,))
    root = Path(tempfile.mkdtemp(prefix="bench-shard-states-"))
    sides = {}
    m = build(args, mesh)
    sides["torch AdamW(fused)"] = (m, torch.optim.AdamW(groups(m), lr=1e-3, betas=(0.9, 0.95), fused=True))
    m = build(args, mesh)
    sides["shard states, host"] = (m, ShardStatesAdamW(groups(m), fsdp_units(m), MemoryStore(Tier.HOST, torch.device(
        "cpu")), lr=1e-3, betas=(0.9, 0.95)))
    m = build(args, mesh)
    sides["shard states, nvme"] = (m, ShardStatesAdamW(groups(m), fsdp_units(m), MemoryStore(
        Tier.HOST, torch.device("cpu")), DiskStore(str(root / f"rank{env.rank}")), lr=1e-3, betas=(0.9, 0.95)))
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {k: [] for k in sides}

    def block(name: str, steps: int) -> float:
        model, opt = sides[name]
        t0 = time.perf_counter()
        for _ in range(steps):
            x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            if args.clip <= 0 and hasattr(opt, "step_during_backward"):
                opt.step_during_backward()  # no clip: each unit steps as its gradients arrive
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            if args.clip > 0:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()
                torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), args.clip, norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if hasattr(opt, "wait"):
            opt.wait()  # its last steps here, not under the next side's forward
        return (time.perf_counter() - t0) / steps

    for name in sides:
        block(name, 2)
    before = {k: o.counters() for k, (_, o) in sides.items() if hasattr(o, "counters")}
    for _ in range(args.rounds):
        for name in sides:
            times[name].append(block(name, args.steps))
    if env.rank == 0:
        params = sum(p.numel() for p in build(args, mesh).parameters())
        base = statistics.median(times["torch AdamW(fused)"])
        print(f"{env.world_size} ranks, GPT {args.layers} x {args.embd} ({params / 1e6:.1f} M parameters), "
              f"{args.batch} x {args.seq} tokens a rank, clip {args.clip}; median of {args.rounds} blocks of {args.steps}")
        for name, ts in times.items():
            med = statistics.median(ts)
            line = f"{name:20} {med * 1e3:8.1f} ms a step  {med / base:5.3f}x torch's"
            if name in before:
                c = sides[name][1].counters()
                opt_s = c["optimizer_s"] - before[name]["optimizer_s"]
                exposed = c["optimizer_exposed_s"] - before[name]["optimizer_exposed_s"]
                line += f"  optimizer {opt_s / (args.rounds * args.steps) * 1e3:6.1f} ms a step, " \
                        f"{exposed / max(opt_s, 1e-12):5.1%} exposed"
            print(line, flush=True)
    for _, opt in sides.values():
        if hasattr(opt, "close"):
            opt.close()
    dist.barrier()
    leave_process(0)


if __name__ == "__main__":
    main()
