"""Benchmarks for memory-centric tiling (issue 5). Each memory figure comes from its own subprocess.

    python benchmarks/bench_tiling.py loss        # (b) LM head + loss at vocab 128k: peak memory, plain vs tiled
    python benchmarks/bench_tiling.py throughput  # (c) TiledLinear fwd+bwd time for several tile counts
    python benchmarks/bench_tiling.py train       # (a) one Linear bigger than the budget, trained tile by tile
    python benchmarks/bench_tiling.py all

Memory is measured as the child process's peak RSS (VmHWM, which the kernel keeps, so it sees every allocation
however short), reset just before the measured step, minus its RSS at that point, when inputs and parameters
already exist. Figures print as Markdown rows for benchmarks/RESULTS.md.

(a) `train` runs four variants on one Linear larger than the budget, each in its own process:
- plain-sgd / plain-adamw: the untiled nn.Linear with torch.optim.SGD / torch.optim.AdamW(fused=True);
- tiled-sgd: `TileStreamer` below, a deliberately small streamer (tile weights live in files; one tile at a time is
  read in, used, SGD-updated in backward and written back) that shows tile-by-tile training without any engine;
- wrap: `tile_linears` + `tightfit.wrap` (every tile its own unit, all states on NVMe files, device budget) +
  `tightfit.optim.AdamW`: the real path.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tightfit  # noqa: E402
from tightfit import Placement, Tier  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402
from tightfit.optim import AdamW  # noqa: E402
from tightfit.tiling import (  # noqa: E402
    TiledLinear,
    grid_for_count,
    plan_tiles,
    tile_linears,
    tiled_cross_entropy,
)

MiB = 1024**2


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM). Not `ru_maxrss`: after fork+exec that also carries the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss()


def _child(args: list[str]) -> dict:
    """Run this script's hidden `_child` command in a fresh process; return its JSON result."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", *args],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- (b) LM head + loss -----------------------------------------------------------------------------------------


def child_loss(variant: str, n: int, c: int, v: int, chunk: int) -> dict:
    torch.manual_seed(0)
    h = torch.randn(n, c, requires_grad=True)  # [N, C]
    w = (torch.randn(v, c) * 0.02).requires_grad_()  # [V, C]
    t = torch.randint(0, v, (n,))
    t[::7] = -100  # some ignored positions (padding)
    before = _reset_peak_rss()
    t0 = time.process_time()  # CPU time of both threads: wall time on this shared machine measures the others
    if variant == "plain":
        loss = F.cross_entropy((h @ w.t()).float(), t)  # [N, V] logits live until backward
    else:
        loss = tiled_cross_entropy(h, w, t, chunk_size=chunk)
    loss.backward()
    dt = time.process_time() - t0
    grad_bytes = (h.numel() + w.numel()) * 4  # dh and dW: outputs of the step, not activations
    return {"variant": variant, "loss": loss.item(), "peak_delta": _peak_rss() - before, "grad_bytes": grad_bytes,
            "seconds": dt}


def bench_loss(n: int, c: int, v: int, chunks: list[int]) -> None:
    print(f"\n### LM head + cross-entropy, N={n} tokens, C={c}, V={v} (fp32)\n")
    print(f"Full logits [N, V] fp32 = {n * v * 4 / MiB:.0f} MiB. 'activation peak' = peak RSS delta of forward+backward "
          "minus the gradient bytes (dh, dW) the step leaves behind.\n")
    print("| variant | loss | peak RSS delta (MiB) | activation peak (MiB) | ratio vs plain | fwd+bwd CPU s |")
    print("|---|---|---|---|---|---|")
    rows = [("plain head + F.cross_entropy", _child(["loss", "plain", str(n), str(c), str(v), "0"]))]
    for ch in chunks:
        rows.append((f"tiled_cross_entropy chunk={ch}", _child(["loss", "tiled", str(n), str(c), str(v), str(ch)])))
    base = rows[0][1]["peak_delta"] - rows[0][1]["grad_bytes"]
    for name, r in rows:
        act = r["peak_delta"] - r["grad_bytes"]
        print(f"| {name} | {r['loss']:.6f} | {r['peak_delta'] / MiB:.0f} | {act / MiB:.0f} | "
              f"{base / act:.1f}x | {r['seconds']:.2f} |")


# ---- (c) throughput -------------------------------------------------------------------------------------------


def bench_throughput(n: int, in_f: int, out_f: int, counts: list[int], grids: list[tuple[int, int]], reps: int) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f)
    x = torch.randn(n, in_f, requires_grad=True)  # [N, in]
    variants = [("nn.Linear", ref)]
    for k in counts:
        in_s, out_s = grid_for_count(k, in_f, out_f)
        variants.append((f"{k} tiles, {out_s}x{in_s} (grid_for_count)", TiledLinear.from_linear(ref, in_s, out_s)))
    for in_s, out_s in grids:
        variants.append((f"{in_s * out_s} tiles, {out_s}x{in_s} (forced)", TiledLinear.from_linear(ref, in_s, out_s)))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    # One thread, timed in process CPU time: on a machine shared with other jobs, wall time mostly measures the
    # others; the CPU time of one thread measures the work (cache contention from neighbours remains).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(reps):  # interleaved, so drift from other jobs on the machine hits every variant alike
        for name, mod in variants:
            t0 = time.process_time()
            mod(x).sum().backward()
            times[name].append(time.process_time() - t0)
            x.grad = None
            mod.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    print(f"\n### TiledLinear forward+backward, x [{n}, {in_f}] -> [{n}, {out_f}] fp32, 1 thread, CPU time, "
          f"{reps} interleaved rounds\n")
    print(f"Grid written out_splits x in_splits; tile = one [out/out_splits, in/in_splits] weight. Load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores after the run: the minimum is the figure to compare "
          "(least disturbed by other jobs), the median shows the noise.\n")
    print("| layer | tile weight | tile matmul FLOP per byte (x_i, W, y_o) | min CPU ms | median CPU ms | "
          "min vs nn.Linear |")
    print("|---|---|---|---|---|---|")
    base = min(times["nn.Linear"])
    for name, mod in variants:
        if isinstance(mod, TiledLinear):
            o, i = mod.out_sizes[0], mod.in_sizes[0]
        else:
            o, i = out_f, in_f
        # Arithmetic intensity of one tile's matmul: 2*N*o*i FLOP over bytes of x_i, W, y_o (fp32).
        ai = 2 * n * o * i / (4 * (n * i + o * i + n * o))
        best, med = min(times[name]), statistics.median(times[name])
        print(f"| {name} | [{o}, {i}] | {ai:.0f} | {best * 1e3:.1f} | {med * 1e3:.1f} | {best / base:.2f}x |")


# ---- (a) training a Linear larger than the budget, tile by tile --------------------------------------------------


def _raw(t: torch.Tensor):
    """The bytes of contiguous CPU tensor `t` as a writable buffer. Not `t.numpy()`: exporting to numpy makes the
    storage non-resizable, and the streamer frees tiles by resizing their storage to 0."""
    return (ctypes.c_char * t.nbytes).from_address(t.data_ptr())


class TileStreamer:
    """Keeps each tile's weight in a file and in memory only while it is used; SGD-updates it in backward.

    A demonstration, not the offload engine. Like FSDP, a released tile keeps its Parameter object and shape but its
    storage is resized to 0 bytes, so the views autograd saved in forward become valid again once the storage is
    refilled:
    - forward pre-hook: refill the storage from the tile's file; forward hook: release it;
    - a hook on the tile's output (fires before the tile's backward): refill it;
    - post-accumulate-grad hook: `w -= lr * grad` (what torch.optim.SGD does), write w back, free grad and storage.
    `resident` counts the bytes of tile weights and gradients in memory; `peak` is its maximum.
    """

    def __init__(self, layer: TiledLinear, folder: str, lr: float) -> None:
        self.folder, self.lr = folder, lr
        self.resident = self.peak = 0
        for k, t in enumerate(layer.tiles):
            # Tiles arrive on "meta"; each gets an empty (0-byte) storage of its shape. Its file holds the values.
            t.weight = p = nn.Parameter(torch.empty(t.weight.shape))
            p.untyped_storage().resize_(0)
            t.register_forward_pre_hook(lambda m, a, k=k: self._fetch(m.weight, k))
            t.register_forward_hook(lambda m, a, y, k=k: self._after_forward(m.weight, y, k))
            p.register_post_accumulate_grad_hook(lambda p, k=k: self._step(p, k))

    @staticmethod
    def write_tiles(w: torch.Tensor, layer: TiledLinear, folder: str) -> None:
        """Write the tiles of the full weight `w` [out, in] as `layer`'s grid cuts it, one file per tile."""
        for o, (oo, os_) in enumerate(zip(layer.out_offsets, layer.out_sizes)):
            for i, (io, is_) in enumerate(zip(layer.in_offsets, layer.in_sizes)):
                w[oo:oo + os_, io:io + is_].contiguous().numpy().tofile(
                    os.path.join(folder, f"tile{o * layer.in_splits + i}.bin"))

    def _path(self, k: int) -> str:
        return os.path.join(self.folder, f"tile{k}.bin")

    def _count(self, n: int) -> None:
        self.resident += n
        self.peak = max(self.peak, self.resident)

    def _fetch(self, p: torch.Tensor, k: int) -> None:
        p.untyped_storage().resize_(p.nbytes)
        with open(self._path(k), "rb") as f:  # read straight into the parameter: no staging copy
            f.readinto(_raw(p))
        self._count(p.nbytes)

    def _write(self, p: torch.Tensor, k: int) -> None:
        with open(self._path(k), "wb") as f:
            f.write(_raw(p))

    def _release(self, p: torch.Tensor) -> None:
        p.untyped_storage().resize_(0)
        self._count(-p.nbytes)

    def _after_forward(self, p: torch.Tensor, y: torch.Tensor, k: int) -> None:
        self._release(p)
        if y.requires_grad:
            y.register_hook(lambda g: self._fetch(p, k))

    def _step(self, p: torch.Tensor, k: int) -> None:
        self._count(p.grad.nbytes)
        with torch.no_grad():
            p.sub_(p.grad, alpha=self.lr)
        self._write(p, k)
        self._count(-p.grad.nbytes)
        p.grad = None
        self._release(p)


def _train_grid(in_f: int, out_f: int, budget: int) -> tuple[int, int]:
    # Each tile's params + grad fit in half the budget: in backward a tile's weight and gradient are resident
    # together, and the next tile's weight is read before the allocator reuses the previous one's memory.
    return plan_tiles(in_f, out_f, 4, budget // 2)


ADAM_LR = 1e-4
HOST_BUDGET_X = int(os.environ.get("HOST_BUDGET_X", "2"))  # wrap: host staging pool = this x the device budget


def child_train(variant: str, in_f: int, out_f: int, n: int, steps: int, budget: int, folder: str) -> dict:
    lr = 0.5
    torch.manual_seed(0)
    x = torch.randn(n, in_f)  # [N, in]: one batch, fitted for `steps` steps, so the loss must fall
    target = torch.randn(n, out_f)  # [N, out]
    start = _rss()
    info = {}
    engine = None
    if variant in ("plain-sgd", "plain-adamw"):
        model = nn.Linear(in_f, out_f, bias=False, device="meta")
        model.weight = nn.Parameter(torch.from_file(os.path.join(folder, "full.bin"), size=out_f * in_f)
                                    .view(out_f, in_f))
        opt = (torch.optim.SGD(model.parameters(), lr=lr) if variant == "plain-sgd"
               else torch.optim.AdamW(model.parameters(), lr=ADAM_LR, fused=True))
    elif variant == "wrap":
        model = nn.Linear(in_f, out_f, bias=False, device="meta")
        model.weight = nn.Parameter(torch.from_file(os.path.join(folder, "full.bin"), size=out_f * in_f)
                                    .view(out_f, in_f))
        model = nn.Sequential(model)
        grid = tile_linears(model, max_tile_bytes=budget // 2)  # in place: model[0] is now a TiledLinear
        # Every state of every tile on NVMe files; the device tier is the CPU with a byte budget.
        placement = Placement.everywhere(Tier.NVME, nvme_dir=os.path.join(folder, "swap"), device_budget=budget,
                                         host_budget=HOST_BUDGET_X * budget)
        tightfit.wrap(model, placement, device="cpu")
        engine = engine_of(model)
        opt = AdamW(model.parameters(), lr=ADAM_LR)
        info = {"grid": f"{model[0].out_splits}x{model[0].in_splits}", "tiles": grid["0"]}
    else:
        in_s, out_s = _train_grid(in_f, out_f, budget)
        model = TiledLinear(in_f, out_f, in_s, out_s, bias=False, device="meta")
        streamer = TileStreamer(model, folder, lr)  # SGD happens inside backward, tile by tile
        opt = None
        info = {"grid": f"{out_s}x{in_s}", "tile_mib": model.tiles[0].weight.nbytes / MiB}
    gc.collect()
    before = _reset_peak_rss()
    info["held_at_start"] = before - start  # what setup left resident (the tiles: nothing, they are in files)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = F.mse_loss(model(x), target)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    info["step_s"] = (time.perf_counter() - t0) / steps
    if variant == "tiled-sgd":
        info["tracked_peak"] = streamer.peak
    if engine is not None:
        info["tracked_peak"] = engine.memory_report()["device"]["peak"]
        engine.close()
    return {"variant": variant, "losses": losses, "peak_delta": _peak_rss() - before, **info}


def bench_train(in_f: int, out_f: int, n: int, steps: int, budget: int, variants: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="tightfit-tiling-") as folder:
        torch.manual_seed(1)
        w = torch.empty(out_f, in_f)
        nn.init.normal_(w, std=in_f**-0.5)
        w.numpy().tofile(os.path.join(folder, "full.bin"))
        in_s, out_s = _train_grid(in_f, out_f, budget)
        TileStreamer.write_tiles(w, TiledLinear(in_f, out_f, in_s, out_s, bias=False, device="meta"), folder)
        del w
        args = [str(in_f), str(out_f), str(n), str(steps), str(budget), folder]
        res = {v: _child(["train", v, *args]) for v in variants}
    wbytes = in_f * out_f * 4
    print(f"\n### One Linear [{out_f}, {in_f}] fp32 ({wbytes / MiB:.0f} MiB weight, "
          f"{2 * wbytes / MiB:.0f} MiB with its gradient), budget {budget / MiB:.0f} MiB, N={n}, "
          f"{steps} steps on one batch\n")
    print(f"Peak RSS delta: process peak minus RSS before the first step; every variant starts with the weight only "
          "in files (plain maps its file lazily), so the delta is all the memory the training steps hold. "
          "Tracked: device bytes the engine (wrap) or the demo streamer (tiled-sgd) held at once. wrap keeps every "
          f"state on NVMe files with a host staging pool of {HOST_BUDGET_X} x the budget, which is in its RSS too.\n")
    print("| variant | optimizer | grid (out x in) | resident before step 1 (MiB) | peak RSS delta (MiB) | "
          "tracked device peak (MiB) | within budget | s/step | losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v, r in res.items():
        # Device budget: the tracked device bytes where a streamer/engine keeps the books (on a CPU box the engine's
        # host staging shares the RSS), else the whole RSS delta.
        ok = "yes" if r.get("tracked_peak", r["peak_delta"]) <= budget else "no"
        tracked = f"{r['tracked_peak'] / MiB:.0f}" if "tracked_peak" in r else "-"
        optname = "SGD lr 0.5" if v.endswith("sgd") else f"AdamW lr {ADAM_LR}"
        print(f"| {v} | {optname} | {r.get('grid', '1x1')} | {r['held_at_start'] / MiB:.0f} | "
              f"{r['peak_delta'] / MiB:.0f} | {tracked} | {ok} | "
              f"{r['step_s']:.2f} | {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    for a, b in (("plain-sgd", "tiled-sgd"), ("plain-adamw", "wrap")):
        if a in res and b in res:
            diff = max(abs(x - y) / abs(x) for x, y in zip(res[a]["losses"], res[b]["losses"]))
            print(f"\nlargest relative loss difference, {b} vs {a}: {diff:.2e}")


# ---- CLI --------------------------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, variant, *rest = sys.argv[2:]
        if kind == "loss":
            res = child_loss(variant, *map(int, rest))
        else:
            res = child_train(variant, *map(int, rest[:5]), rest[5])
        print(json.dumps(res))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["loss", "throughput", "train", "all"])
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--train-features", type=int, default=16384, help="square Linear for `train` (16384: 1 GiB fp32)")
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train-variants", default="plain-sgd,tiled-sgd,plain-adamw,wrap",
                   help="comma-separated subset of plain-sgd, tiled-sgd (demo streamer), plain-adamw, wrap")
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus")
    if a.what in ("loss", "all"):
        bench_loss(a.tokens, a.hidden, a.vocab, [a.tokens // 8, a.tokens // 32])
    if a.what in ("throughput", "all"):
        bench_throughput(512, 2048, 2048, [4, 16, 64, 256], [(4, 4), (1, 64), (1, 256)], reps=7)
    if a.what in ("train", "all"):
        f = a.train_features
        bench_train(f, f, 32, a.steps, a.budget_mib * MiB, a.train_variants.split(","))


if __name__ == "__main__":
    main()
