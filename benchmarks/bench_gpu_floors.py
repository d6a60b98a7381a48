"""The machine's floors, what an offloaded step cannot beat: the CPU optimizer's rate and the host<->device links.

    python benchmarks/bench_gpu_floors.py --json-out runs/gpu-check/floors.json   # on a GPU machine
    python benchmarks/bench_gpu_floors.py --device cpu                              # smoke: the code path

- CPU AdamW: `torch._fused_adamw_` (what the engine's step runs) over fp32 params, grads and moments of `--numel`
  elements, with the engine's threads (torch's intra-op threads as this process has them), in parameters per second.
  Also at the engine's step thread's counts on a GPU machine ([Note: thread budget] in offload/runtime/workers.py:
  beside the gradient worker, and alone once backward is over) and at the planner probe's size (4 M elements,
  whose working set may sit in a large last-level cache where a unit of a large model's does not).
- Host<->device copies of `--mib` MiB between page-locked host memory and the GPU: host-to-device alone,
  device-to-host alone, and both at once on two streams (what an offloaded step does: fetches up, gradients down),
  in bytes per second each way.
- Contention: the engine's host threads share the host's memory with each other and with the copies' DMA. The
  gradient worker's widening add (a bf16 pack into its fp32 sum, `add_widening`) on its thread count alone, beside
  AdamW on the step thread's count, and (CUDA) beside both-way copies; AdamW alone and beside the widening add;
  AdamW with the new master's cast to bf16, a span at a time, as the engine steps a unit on the CPU. Each
  "beside" runs the other side in a second thread, without pause, while the first is timed. The second H200 run's
  step thread measured half its floor rate beside the worker, and the host-only Llama's worker 1.5x slower than the
  probe's pass rate (benchmarks/RESULTS.md, batch Z): these say which share each loses to which.
- With `--nvme DIR`: the disk under DIR, read and written with O_DIRECT at 8 transfers in flight (the planner's
  burst probe, `tightfit.planner.disk_probe.probe_disk`, over `--disk-mib` MiB).
`bench_gpu_llama.py` and `bench_offload_fsdp.py` put each offloaded step against max(compute, transfers, CPU
optimizer) on these figures (scripts/gpu_check_report.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _median_seconds(fn, sync, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:  # the first runs warm the kernels, the pages and the clocks
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adam_rate(numel: int, reps: int) -> float:
    """Parameters per second of the fused CPU AdamW step over one flat buffer set."""
    import torch

    p, g, m, v = (torch.rand(numel) for _ in range(4))
    step = torch.tensor(0.0)

    def run() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, maximize=False)

    return numel / _median_seconds(run, lambda: None, reps)


def adam_rates_by_threads(numel: int, reps: int) -> dict[str, float]:
    """Parameters per second at each of the engine's step-thread counts (keys: thread counts), and at the probe's
    4 M elements on every thread ("probe_size")."""
    import torch

    from tightfit.offload.runtime.workers import thread_budget

    total = torch.get_num_threads()
    budget = thread_budget(total, cuda=True)
    rates = {}
    try:
        for n in sorted({budget["step"], budget["alone"], total}):
            torch.set_num_threads(n)
            rates[str(n)] = adam_rate(numel, reps)
    finally:
        torch.set_num_threads(total)
    rates["probe_size"] = adam_rate(4 << 20, reps)
    return rates


def _beside(fn, other, threads: int, other_threads: int, sync, reps: int) -> float:
    """Median seconds of `fn` on `threads` intra-op threads while a second thread runs `other` (on its own count)
    without pause; `other` None: alone."""
    import threading

    from tightfit.offload.runtime.workers import set_own_threads

    stop = threading.Event()

    def loop() -> None:
        set_own_threads(other_threads)
        while not stop.is_set():
            other()

    t = threading.Thread(target=loop, daemon=True) if other is not None else None
    if t is not None:
        t.start()
    try:
        set_own_threads(threads)
        return _median_seconds(fn, sync, reps)
    finally:
        stop.set()
        if t is not None:
            t.join()


def contention(device: str, numel: int, nbytes: int, reps: int) -> dict[str, float]:
    """Rates of the gradient worker's widening add (bytes/s: the pack read, the sum read and written) and of AdamW
    (params/s), alone and beside each other and (CUDA) the widening beside both-way copies."""
    import torch

    from tightfit.offload.runtime.widening import add_widening
    from tightfit.offload.runtime.workers import thread_budget
    from tightfit.offload.step.adamw import SPAN

    total = torch.get_num_threads()
    budget = thread_budget(total, cuda=True)
    pack, acc = torch.rand(numel).to(torch.bfloat16), torch.zeros(numel)
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    step = torch.tensor(0.0)

    def widen() -> None:
        add_widening(acc, pack)

    def adam() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, maximize=False)

    def none() -> None:
        pass

    compute = torch.empty(numel, dtype=torch.bfloat16)

    def adam_cast() -> None:  # the engine's CPU step of a unit: AdamW, then the new master's cast, a span at a time
        for a in range(0, numel, SPAN):
            b = min(numel, a + SPAN)
            torch._fused_adamw_([p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step], amsgrad=False, lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False)
            compute[a:b].copy_(p[a:b])

    widen_b, adam_n = 10 * numel, numel
    out = {"widen_threads": budget["grads"], "adam_threads": budget["step"]}
    try:
        out["adam_cast_alone_params_per_s"] = adam_n / _beside(adam_cast, None, budget["step"], 0, none, reps)
        out["widen_alone_bytes_per_s"] = widen_b / _beside(widen, None, budget["grads"], 0, none, reps)
        out["widen_beside_adam_bytes_per_s"] = widen_b / _beside(widen, adam, budget["grads"], budget["step"], none,
                                                                 reps)
        out["adam_alone_params_per_s"] = adam_n / _beside(adam, None, budget["step"], 0, none, reps)
        out["adam_beside_widen_params_per_s"] = adam_n / _beside(adam, widen, budget["step"], budget["grads"], none,
                                                                 reps)
        if device == "cuda":
            h2d, d2h = _pinned_copies(nbytes)

            def copies() -> None:
                h2d()
                d2h()
                torch.cuda.synchronize()

            out["widen_alone_all_threads_bytes_per_s"] = widen_b / _beside(widen, None, budget["alone"], 0, none,
                                                                           reps)
            out["widen_beside_copies_bytes_per_s"] = widen_b / _beside(widen, copies, budget["alone"], 1, none, reps)
    finally:
        torch.set_num_threads(total)
    return out


def _pinned_copies(nbytes: int):
    """(host->device, device->host): each issues one copy of `nbytes` between page-locked host memory and the GPU on
    a stream of its own, without waiting for it."""
    import torch

    host_up, host_down = torch.empty(nbytes // 4, pin_memory=True), torch.empty(nbytes // 4, pin_memory=True)
    dev_up, dev_down = torch.empty(nbytes // 4, device="cuda"), torch.ones(nbytes // 4, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        with torch.cuda.stream(up):
            dev_up.copy_(host_up, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(down):
            host_down.copy_(dev_down, non_blocking=True)

    return h2d, d2h


def copy_rates(device: str, nbytes: int, reps: int) -> dict:
    """Bytes per second host->device, device->host, and each way while both run at once."""
    import torch

    if device != "cuda":
        a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        t = _median_seconds(lambda: b.copy_(a), lambda: None, reps)
        return {"h2d": nbytes / t, "d2h": nbytes / t, "both_h2d": nbytes / t, "both_d2h": nbytes / t}
    h2d, d2h = _pinned_copies(nbytes)

    def both() -> None:
        h2d()
        d2h()

    t_up, t_down, t_both = (_median_seconds(f, torch.cuda.synchronize, reps) for f in (h2d, d2h, both))
    return {"h2d": nbytes / t_up, "d2h": nbytes / t_down, "both_h2d": nbytes / t_both, "both_d2h": nbytes / t_both}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=64 << 20, help="parameters of the AdamW measurement")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of each copy")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu (smoke test)")
    ap.add_argument("--nvme", default=None, help="also measure the disk under this folder")
    ap.add_argument("--disk-mib", type=int, default=1024)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {"benchmark": "bench_gpu_floors", "device": device, "torch_threads": torch.get_num_threads(),
           "adamw_params_per_s": adam_rate(args.numel, args.reps), "adamw_numel": args.numel,
           "adamw_by_threads": adam_rates_by_threads(args.numel, args.reps),
           "copy_bytes": args.mib << 20, **{f"{k}_bytes_per_s": v for k, v in
                                           copy_rates(device, args.mib << 20, args.reps).items()}}
    out["contention"] = contention(device, args.numel // 2, args.mib << 20, args.reps)
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    if args.nvme:
        from tightfit.planner.disk_probe import probe_disk

        Path(args.nvme).mkdir(parents=True, exist_ok=True)
        disk = probe_disk(args.nvme, args.disk_mib << 20)
        out.update(nvme_read_bytes_per_s=disk.read_Bps, nvme_write_bytes_per_s=disk.write_Bps)
    print(f"CPU AdamW {out['adamw_params_per_s'] / 1e9:.2f} Gparam/s on {out['torch_threads']} threads; "
          f"H2D {out['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {out['d2h_bytes_per_s'] / 1e9:.1f} GB/s, both at once "
          f"{out['both_h2d_bytes_per_s'] / 1e9:.1f} + {out['both_d2h_bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
