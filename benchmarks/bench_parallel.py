"""Scale-out benchmarks on CPU/gloo: pipeline bubble vs micro-batches, and DDP/ZeRO bytes per step vs analytic.

    .venv/bin/python benchmarks/bench_parallel.py            # both parts, prints markdown tables
    .venv/bin/python benchmarks/bench_parallel.py --part bubble --ranks 2
    .venv/bin/python benchmarks/bench_parallel.py --part comm --ranks 2

The driver re-launches itself under torchrun (one launch per part); rank 0 writes JSON, the driver prints tables.

Bubble (default `--compute sleep`): p stages whose forward and backward take a fixed time (sleeps: on a shared
2-core VM real compute is stretched by other jobs, sleeps are not), driven by tightfit's `apply_pp` with torch's
schedules; idle = 1 − m·(t_f + t_b) / step time. `--compute gpt`: a p-stage reference GPT (2 blocks per stage,
balanced by cost), m micro-batches of a fixed size; busy = time inside the stage's own compute
(PipelineStage.forward_one_chunk / backward_one_chunk, timed in place); idle = 1 − busy / step time. Both against
(p − 1)/(m + p − 1).

Communication: bytes handed to collectives in one training step, counted where PyTorch issues them — a DDP comm
hook for the gradient buckets (ddp, zero1), and wrappers around the `torch.distributed` functions that FSDP2
(`all_gather_single`, `reduce_scatter_single`) and ZeroRedundancyOptimizer (`broadcast`) call. "Payload" is the
full size of each collective's tensor (an all-gather counts its gathered output); the analytic payload is
Ψ per all-reduce / all-gather / reduce-scatter of all parameters (Ψ = fp32 bytes of the model). Bytes each rank
actually sends over a ring follow as (n−1)/n × payload (×2 for an all-reduce); costs.comm_per_step is that figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------------- bubble
def bubble_worker(out: Path, mbs: int, ms: list[int], steps: int) -> None:
    import torch.distributed as dist

    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.parallel import ParallelDims, ParallelPlan, build_mesh, init_distributed, parallelize

    env = init_distributed()
    p = env.world_size
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2 * p, n_head=4, n_embd=256, bias=False)
    T = cfg.block_size

    busy = [0.0]

    def timed(fn):
        """Wrap a PipelineStage compute method: forward_one_chunk / backward_one_chunk run the stage's own
        compute only (receives were waited for before, sends are issued after)."""
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t0
        return inner

    rows = []
    for sched in ("gpipe", "1f1b"):
        for m in ms:
            if sched == "1f1b" and m < p:  # 1F1B needs a micro-batch per stage
                continue
            torch.manual_seed(0)
            plan = ParallelPlan(ParallelDims(pp=p), pp_schedule=sched, pp_microbatches=m)
            pm = parallelize(GPT(cfg), plan, build_mesh(plan.dims, env.device), env.device)
            stage = pm.schedule._stage
            stage.forward_one_chunk = timed(stage.forward_one_chunk)
            stage.backward_one_chunk = timed(stage.backward_one_chunk)
            x = torch.randint(0, 256, (m * mbs, T))
            samples = []
            for s in range(steps + 1):
                dist.barrier()
                busy[0] = 0.0
                t0 = time.perf_counter()
                pm.forward_backward(x, x)
                dist.barrier()  # the step ends when the last stage's last backward has reached stage 0
                samples.append((time.perf_counter() - t0, busy[0]))
                for q in pm.module.parameters():
                    q.grad = None
            samples = samples[1:]  # the first step also infers shapes
            # The median step (and its busy time): other jobs on a shared machine make single steps slow.
            step_t, busy_t = sorted(samples)[len(samples) // 2]
            # The bubble is what the *slowest* stage waits; with balanced stages every stage sees about the same.
            all_idle = [None] * p
            dist.all_gather_object(all_idle, 1 - busy_t / step_t)
            rows.append({"schedule": sched, "m": m, "step_s": step_t, "busy_s": busy_t,
                         "idle_per_stage": all_idle, "idle_mean": sum(all_idle) / p,
                         "theory": (p - 1) / (m + p - 1)})
    if env.rank == 0:
        out.write_text(json.dumps({"p": p, "mbs": mbs, "seq": T, "rows": rows}, indent=1))
    dist.destroy_process_group()


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps t_f and backward t_b: compute of a fixed duration that CPU contention from
    other jobs cannot stretch, so the measured idle time is the schedule's bubble (plus real send/recv cost)."""

    @staticmethod
    def forward(ctx, x, t_f: float, t_b: float):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        return g, None, None


class SleepStage(torch.nn.Module):
    def __init__(self, width: int, t_f: float, t_b: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(width))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, T, C] -> [mb, T, C]
        return _Sleep.apply(x * self.w, self.t_f, self.t_b)


def sleep_bubble_worker(out: Path, ms: list[int], steps: int, t_f: float, t_b: float) -> None:
    """The bubble of torch's GPipe/1F1B with fixed-duration stages (p = world size), through tightfit's apply_pp."""
    import torch.distributed as dist

    from tightfit.parallel import ParallelDims, apply_pp, build_mesh, init_distributed

    env = init_distributed()
    p = env.world_size
    mesh = build_mesh(ParallelDims(pp=p), env.device)
    rows = []
    for sched in ("gpipe", "1f1b"):
        for m in ms:
            if sched == "1f1b" and m < p:
                continue
            stage_mod = SleepStage(64, t_f, t_b)
            schedule = apply_pp(stage_mod, mesh["pp"], env.device, sched, m, loss_fn=lambda o, y: o.float().mean())
            x = torch.randn(m * 2, 16, 64)
            times = []
            for s in range(steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if env.rank == 0:
                    schedule.step(x)
                elif env.rank == p - 1:
                    schedule.step(target=x, losses=[])
                else:
                    schedule.step()
                dist.barrier()
                times.append(time.perf_counter() - t0)
            step_t = sorted(times[1:])[len(times[1:]) // 2]
            busy = m * (t_f + t_b)
            rows.append({"schedule": sched, "m": m, "step_s": step_t, "busy_s": busy,
                         "idle": 1 - busy / step_t, "theory": (p - 1) / (m + p - 1)})
    if env.rank == 0:
        out.write_text(json.dumps({"p": p, "t_f": t_f, "t_b": t_b, "rows": rows}, indent=1))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------ comm
class ByteCounter:
    """Sums the payload of each kind of collective issued while `active`."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.active = False

    def add(self, kind: str, t: torch.Tensor) -> None:
        if self.active:
            self.bytes[kind] = self.bytes.get(kind, 0) + t.numel() * t.element_size()


def comm_worker(out: Path, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.parallel import ParallelDims, ParallelPlan, build_mesh, init_distributed, make_optimizer, parallelize
    from tightfit.parallel.costs import ModelProfile, comm_per_step

    env = init_distributed()
    n = env.world_size
    counter = ByteCounter()
    # Wrap the functions FSDP2 and ZeroRedundancyOptimizer call (looked up on the module at call time).
    orig = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single", "broadcast")}

    def wrap(kind, fn, pick):
        def inner(*a, **k):
            counter.add(kind, pick(a, k))
            return fn(*a, **k)
        return inner

    dist.all_gather_single = wrap("all_gather", orig["all_gather_single"], lambda a, k: a[0])
    dist.reduce_scatter_single = wrap("reduce_scatter", orig["reduce_scatter_single"],
                                      lambda a, k: k.get("input", a[1] if len(a) > 1 else None))
    dist.broadcast = wrap("broadcast", orig["broadcast"], lambda a, k: k.get("tensor", a[0] if a else None))

    def counting_hook(state, bucket):
        counter.add("all_reduce", bucket.buffer())
        return allreduce_hook(state, bucket)

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128, bias=False)
    rows = []
    for mode in ("ddp", "zero1", "zero2", "zero3"):
        torch.manual_seed(0)
        model = GPT(cfg)
        n_params = model.num_params()
        blocks = sum(q.numel() for q in model.blocks.parameters())
        plan = ParallelPlan(ParallelDims(dp=n), mode)
        pm = parallelize(model, plan, build_mesh(plan.dims, env.device), env.device)
        if mode in ("ddp", "zero1"):
            pm.module.register_comm_hook(state=None, hook=counting_hook)
        opt = make_optimizer(pm, lr=1e-3)
        x = torch.randint(0, 256, (4, cfg.block_size))
        for s in range(steps + 1):
            counter.active = s == steps  # count the last step only (the first builds buckets, states)
            pm.forward_backward(x, x)
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.active = False
        psi = n_params * 4
        analytic = {"ddp": {"all_reduce": psi}, "zero1": {"all_reduce": psi, "broadcast": psi},
                    "zero2": {"all_gather": psi, "reduce_scatter": psi},
                    # blocks are re-gathered in backward; the root (embeddings, head) stays gathered
                    "zero3": {"all_gather": psi + blocks * 4, "reduce_scatter": psi}}[mode]
        prof = ModelProfile(n_params=n_params, largest_layer_params=0, largest_block_params=0, n_layers=4,
                            n_heads=4, hidden=128, vocab=256, seq_len=32, micro_batch=4, mixed_precision=False,
                            blocks_params=blocks)
        wire = comm_per_step(plan, prof)["dp"]
        measured = dict(counter.bytes)
        counter.bytes.clear()
        rows.append({"mode": mode, "n": n, "params": n_params, "measured": measured, "analytic": analytic,
                     "model_wire_bytes_per_rank": wire})
        del pm, opt
    if env.rank == 0:
        out.write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------- driver
def _launch(part: str, ranks: int, extra: list[str]) -> dict:
    out = Path(f"/tmp/bench_parallel_{part}_{os.getpid()}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={_free_port()}",
           __file__, "--worker", part, "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def _mib(b: int) -> str:
    return f"{b / 2**20:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("bubble", "comm", "all"), default="all")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--worker", choices=("bubble", "sleep", "comm"))
    ap.add_argument("--compute", choices=("sleep", "gpt"), default="sleep",
                    help="bubble stages: fixed-duration sleeps (robust on a shared machine) or a real GPT")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mbs", type=int, default=4, help="sequences per micro-batch (bubble)")
    ap.add_argument("--ms", default="1,2,4,8,16", help="micro-batch counts (bubble)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.worker == "bubble":
        return bubble_worker(a.out, a.mbs, [int(m) for m in a.ms.split(",")], a.steps)
    if a.worker == "comm":
        return comm_worker(a.out, a.steps)
    if a.worker == "sleep":
        return sleep_bubble_worker(a.out, [int(m) for m in a.ms.split(",")], a.steps, 0.02, 0.04)
    if a.part in ("bubble", "all") and a.compute == "sleep":
        r = _launch("sleep", a.ranks, ["--ms", a.ms, "--steps", str(a.steps)])
        print(f"\nPP bubble: p={r['p']} stages of fixed compute (forward {r['t_f'] * 1e3:.0f} ms + backward "
              f"{r['t_b'] * 1e3:.0f} ms per micro-batch)\n")
        print("| schedule | m | step (s) | busy m·(t_f+t_b) (s) | measured idle | (p−1)/(m+p−1) |")
        print("|---|---|---|---|---|---|")
        for row in r["rows"]:
            print(f"| {row['schedule']} | {row['m']} | {row['step_s']:.3f} | {row['busy_s']:.3f} | "
                  f"{row['idle']:.3f} | {row['theory']:.3f} |")
    if a.part in ("bubble", "all") and a.compute == "gpt":
        r = _launch("bubble", a.ranks, ["--mbs", str(a.mbs), "--ms", a.ms, "--steps", str(a.steps)])
        print(f"\nPP bubble: p={r['p']} stages, micro-batch {r['mbs']} x {r['seq']} tokens\n")
        print("| schedule | m | step (s) | stage-0 busy (s) | idle per stage | idle mean | (p−1)/(m+p−1) |")
        print("|---|---|---|---|---|---|---|")
        for row in r["rows"]:
            print(f"| {row['schedule']} | {row['m']} | {row['step_s']:.3f} | {row['busy_s']:.3f} | "
                  f"{', '.join(f'{v:.2f}' for v in row['idle_per_stage'])} | {row['idle_mean']:.3f} | "
                  f"{row['theory']:.3f} |")
    if a.part in ("comm", "all"):
        rows = _launch("comm", a.ranks, ["--steps", str(a.steps)])
        print(f"\nData-parallel payload per step, n={rows[0]['n']} ranks, {rows[0]['params']:,} fp32 params "
              f"(Ψ = {_mib(rows[0]['params'] * 4)} MiB)\n")
        print("| mode | collective | measured MiB | analytic MiB | ratio | costs.py bytes sent per rank (MiB) |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            for kind in sorted(set(row["measured"]) | set(row["analytic"])):
                m, an = row["measured"].get(kind, 0), row["analytic"].get(kind, 0)
                print(f"| {row['mode']} | {kind} | {_mib(m)} | {_mib(an)} | {m / an if an else float('nan'):.3f} | "
                      f"{_mib(row['model_wire_bytes_per_rank'])} |")


if __name__ == "__main__":
    main()
