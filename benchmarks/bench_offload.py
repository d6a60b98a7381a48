"""Offload engine benchmarks (issue 3 acceptance 2-4): memory, NVMe bandwidth during training, overlap.

    # 2 + 3: a model whose fp32 Adam state (16 B/param) is >= 10x the memory budget, every state on NVMe
    .venv/bin/python benchmarks/bench_offload.py memory --folder /tmp/tf_bench --layers 64 --embd 384
    # 4: all-NVMe step time vs max(compute-only step, I/O-only time of the same step's traffic)
    .venv/bin/python benchmarks/bench_offload.py overlap --folder /tmp/tf_bench --layers 24 --embd 384

memory: the reference GPT is built on the meta device (it never exists in host memory), wrapped with every state
on NVMe, a device budget (the CPU is the device here) and a host budget, initialised unit by unit through
`import_state`, then trained with activation checkpointing of every block. A thread samples the RSS every 5 ms.
The fixed overhead of the torch runtime is the RSS measured in the same process before the big model exists,
after a warm-up step of a tiny wrapped model (libraries, thread pools, autograd and allocator state).
Afterwards the NVMe tier's bandwidth during the training steps (bytes per busy second, from NvmeStore.stats) is
put next to raw sequential O_DIRECT of the same volume in the same folder (benchmarks/disk_reference.py).

overlap: the same model trained with every state on the device tier (compute only, no I/O), then on NVMe (first
with the optimizer after backward, then with `step_during_backward`, the overlapped step); the
I/O-only time replays the NVMe step's exact traffic (params read in forward and backward, gradients written,
master/gradients/moments read and master/moments written by the optimizer) through the engine's own store with
no compute, all requests of a phase in flight at once.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

import tightfit  # noqa: E402
from tightfit import Placement, Tier  # noqa: E402
from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402
from tightfit.offload.tiers.nvme.store import DiskTuning  # noqa: E402
from tightfit.offload.model_state.state_io import import_state  # noqa: E402
from tightfit.optim import AdamW  # noqa: E402

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from disk_reference import RawMixedDisk, kernel_disk_stats  # noqa: E402

MiB = 1 << 20


def _fixed_mmap_threshold() -> None:
    """Make glibc give freed memory back: it raises its mmap threshold after large frees and keeps freed unit
    buffers in its heaps (one per thread that allocates). Pin the threshold at 64 KiB (activations of this model are ~100 KB), trim heaps above 1 MiB of free
    top, and use two heaps at most (what a long-running trainer wants too; the same as MALLOC_* env variables)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


class RssSampler:
    """Peak RSS of this process, sampled every `period` seconds on a daemon thread (stopped by `stop`)."""

    def __init__(self, period: float = 0.005) -> None:
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _init_value(name: str, shape: torch.Size) -> torch.Tensor:
    """Deterministic GPT-style init for one parameter, made on demand (the model never exists whole in memory)."""
    if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable across processes, unlike hash()
    return torch.randn(shape, generator=g) * 0.02


def _batch(cfg: GPTConfig, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return x, torch.roll(x, -1, 1)


def _build(cfg: GPTConfig, placement: Placement, disk: DiskTuning | None = None) -> tuple[torch.nn.Module, AdamW]:
    """The model on the meta device, wrapped, initialised unit by unit. disk: the NVMe tier's tuning (None: what
    it derives, [Note: disk tuning] in tightfit/offload/tiers/nvme/tuning.py)."""
    with torch.device("meta"):
        model = GPT(cfg)
    names = [n for n, _ in model.named_parameters()]
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    tightfit.wrap(model, placement, device="cpu", disk=disk)
    import_state(model, None, lambda key: _init_value(key[len("model."):], shapes[key[len("model."):]]))
    try:  # the init's temporaries fragment glibc's heap; give the free pages back before training
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    assert len(names) == len(shapes)
    return model, AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def _train(model, opt, cfg, batch: int, steps: int, early: bool = False, after_step=None) -> list[float]:
    """Train `steps` steps; times per step. after_step(step) runs after each step, outside the timing.

    early: each unit steps during backward (no clipping). Otherwise the step runs after backward, as with clipping,
    and the optimizer states load during backward, as `tightfit train` does then (`preload_during_backward`)."""
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = _batch(cfg, batch, step)
        loss = model(x, y)
        if early:
            opt.step_during_backward()  # no clipping here: each unit steps as soon as its gradients land
        else:
            opt.preload_during_backward()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        print(f"  step {step}: loss {loss.item():.4f}  {times[-1]:.2f} s", flush=True)
        if after_step is not None:
            after_step(step)
    return times


def _disk_tuning(args) -> DiskTuning:
    """--io-threads / --chunk-kib as the NVMe tier's tuning; what is not given the tier derives itself."""
    return DiskTuning(threads=args.io_threads, chunk_bytes=None if args.chunk_kib is None else args.chunk_kib << 10)


def _config(args) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.embd // 64,
                     n_embd=args.embd)


def _warm_up() -> None:
    """One wrapped step of a tiny model: loads every library and starts the runtime's threads and pools.

    It also runs a torch op on a second thread (the host-tier copy), which on the benchmark VM is what makes the
    main thread's matmuls run at full speed (10x slower before it: an OpenMP quirk); every measured run of this
    script starts after it, so compute-only and offloaded runs are compared under the same conditions."""
    model = tightfit.wrap(GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)),
                          Placement.everywhere(Tier.HOST))
    opt = AdamW(model.parameters())
    x = torch.randint(0, 256, (1, 16))
    model(x, x).backward()
    opt.step()
    engine_of(model).close()


def _raw_in_subprocess(folder: Path, volume: int) -> dict:
    """Raw sequential O_DIRECT bandwidth of `volume` bytes in `folder`, measured by a child process (its 1 GiB of
    random staging memory must not count in this process's peak RSS)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[3]); "
            "from disk_reference import measure_raw, staging_buffer; v = int(sys.argv[2]); "
            "r = measure_raw(sys.argv[1], v, queue_depth=8, staging=staging_buffer(min(v, 1 << 30))); "
            "print(json.dumps({'read': r.read_Bps, 'write': r.write_Bps, 'method': r.method}))")
    folder.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", code, str(folder), str(volume), _HERE], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


class RawMixedProbe:
    """The raw mixed reference (`disk_reference.RawMixedDisk`), measured on demand by one long-lived child process.

    A child, so its ~1 GiB of staging memory does not count in this process's peak RSS; long-lived, so a
    measurement starts the moment it is asked for (a fresh interpreter per measurement left the disk idle for the
    ~2 s of importing torch right before the raw transfer, and not before the training step). Its scratch files
    stay laid out between measurements (the first one writes them, untimed)."""

    # Two buffer layouts, the faster taken each time (the stricter reference): 1 GiB of distinct memory, and fio's
    # layout (one buffer per request in flight, reused). Through ordinary pages either could be the faster by up to
    # 25%; through huge pages they are within a few percent.
    _CODE = ("import sys; sys.path.insert(0, sys.argv[2]); from disk_reference import RawMixedDisk, staging_buffer\n"
             "disks = [RawMixedDisk(sys.argv[1], staging=staging_buffer(n)) for n in (1 << 30, 8 * (4 << 20))]\n"
             "print('ready', flush=True)\n"
             "for line in sys.stdin:\n"
             "    r, w = map(int, line.split())\n"
             "    print(min(d.seconds(r, w) for d in disks), flush=True)\n"
             "for d in disks: d.close()\n")

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", self._CODE, str(folder), _HERE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the raw disk probe did not start")

    def seconds(self, read_bytes: int, write_bytes: int) -> float:
        """Seconds the raw disk takes to read `read_bytes` and write `write_bytes` at once, measured now."""
        self.proc.stdin.write(f"{read_bytes} {write_bytes}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the raw disk probe died")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def memory(args) -> dict:
    """Acceptance 2 (memory) and 3 (NVMe bandwidth during training) in one run.

    Bandwidth: bytes each direction moved during the steps after the first, per second of disk time that
    direction had (NvmeStore's `read_share_s` / `write_share_s`: busy time split by the chunks each direction had
    in flight, so time when reads and writes overlap is not charged twice), against raw sequential O_DIRECT
    transfers of one step's volume in the same folder, measured right before and right after training (the
    virtual disk of the benchmark machine drifts by tens of percent between minutes; the mean of the two is the
    reference, both are reported). `disk_time_efficiency`: seconds the raw disk needs for everything moved, over
    the seconds the tier kept the disk busy; `mixed_per_step`: per step, the raw disk's time for that step's
    reads and writes issued together (the mean of the measurements right before and right after the step), over
    the tier's busy time in the step."""
    _fixed_mmap_threshold()
    _warm_up()
    overhead = psutil.Process().memory_info().rss
    cfg = _config(args)
    with torch.device("meta"):
        n_params = GPT(cfg).num_params()
    device_budget = args.device_mib * MiB
    host_budget = args.host_mib * MiB
    budget = device_budget + host_budget
    folder = Path(args.folder) / "memory"
    shutil.rmtree(folder, ignore_errors=True)
    checkpointed = [f"blocks.{i}" for i in range(cfg.n_layer)]
    # The device budget holds the model's activations as well as the engine's buffers; the engine meters only its
    # own. Split the budget as the planner does: its estimate of the activations (measured on the meta device:
    # every block's checkpointed input, one block's recomputation, the loss's transients) comes off the top.
    from tightfit.planner.costs import act_bytes
    from tightfit.planner.model_profile import profile_model

    with torch.device("meta"):
        activations = act_bytes(profile_model(GPT(cfg), args.batch, args.seq), set(checkpointed))
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(folder), device_budget=device_budget - activations,
                                     host_budget=host_budget, prefetch_depth=args.prefetch,
                                     checkpoint_units=checkpointed, min_unit_bytes=(args.min_unit_mib << 20) or None)
    volume = 28 * n_params  # one step's traffic each way, about (fwd + bwd params, moments, write-backs)
    raw_before = _raw_in_subprocess(folder / "raw", volume)
    sampler = RssSampler()
    model, opt = _build(cfg, placement, _disk_tuning(args))
    engine = engine_of(model)
    disk = engine.stores[Tier.NVME].nvme
    # Per step: the tier's disk traffic and busy time, then (training paused) the raw disk's time for exactly
    # those bytes read and written at once. A virtual disk's speed varies between minutes, so only adjacent raw
    # figures are a fair reference: a step's reference brackets it, the mean of the raw time measured right before
    # it (after the previous step, scaled to this step's bytes) and right after. Two raw references: through the
    # engine's own idle pool buffers, in this process (the very memory the tier's transfers land in: how scattered
    # a buffer's pages are changed a transfer's speed by up to 3x, aligned.py), and through fresh memory in a child
    # process (the faster of two buffer layouts).
    probe = RawMixedProbe(folder / "raw")
    (folder / "raw-same-memory").mkdir(parents=True, exist_ok=True)
    same_memory = RawMixedDisk(folder / "raw-same-memory")
    idle_bytes: list[int] = []
    marks: list[dict] = [disk.stats()]
    raws: dict[str, list[float]] = {"same": [], "fresh": []}
    mixed: list[dict] = []
    # The kernel's counters of the disk (io_ticks, time_in_queue) over each measured step, the raw references
    # between steps left out: its busy time and mean queue depth during training (disk_reference.kernel_disk_stats).
    kernel: list[tuple[float, float]] = []
    k_start = [kernel_disk_stats(folder)]

    def after_step(step: int) -> None:
        engine.wait_writes()  # this step's write-backs belong to it (they would otherwise run into the next)
        marks.append(disk.stats())
        k_end = kernel_disk_stats(folder)
        if step >= 1 and k_end is not None and k_start[0] is not None:
            kernel.append((k_end[0] - k_start[0][0], k_end[1] - k_start[0][1]))
        dr = marks[-1]["bytes_read"] - marks[-2]["bytes_read"]
        dw = marks[-1]["bytes_written"] - marks[-2]["bytes_written"]
        busy = marks[-1]["busy_s"] - marks[-2]["busy_s"]
        idle = engine.pool.idle_buffers()
        idle_bytes.append(sum(b.numel() for b in idle))
        raws["same"].append(same_memory.seconds(dr, dw, memory=idle))
        del idle
        raws["fresh"].append(probe.seconds(dr, dw))
        if step >= 1:
            prev = (marks[-2]["bytes_read"] - marks[-3]["bytes_read"]
                    + marks[-2]["bytes_written"] - marks[-3]["bytes_written"])
            row = {"read": dr, "written": dw, "busy_s": busy}
            for k, v in raws.items():
                before_s = v[-2] * (dr + dw) / prev
                row[f"raw_{k}_s"] = ((before_s + v[-1]) / 2)
                row[f"efficiency_{k}"] = row[f"raw_{k}_s"] / busy
            mixed.append(row)
        k_start[0] = kernel_disk_stats(folder)

    times = _train(model, opt, cfg, args.batch, args.steps, early=args.early, after_step=after_step)
    probe.close()
    same_memory.close()
    before, after = marks[1], marks[-1]
    peak = max(sampler.stop(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    rep = engine.memory_report()
    timings = {k: round(v, 3) for k, v in engine.timings().items() if k != "nvme"}
    d = {k: after[k] - before[k] for k in ("bytes_read", "bytes_written", "read_busy_s", "write_busy_s", "busy_s",
                                           "read_share_s", "write_share_s")}
    kernel_busy = sum(b for b, _ in kernel)
    engine.close()
    raw_after = _raw_in_subprocess(folder / "raw", volume)
    raw = {k: (raw_before[k] + raw_after[k]) / 2 for k in ("read", "write")}
    train_read = d["bytes_read"] / d["read_share_s"]
    train_write = d["bytes_written"] / d["write_share_s"]
    out = {
        "params": n_params, "adam_state_bytes": 16 * n_params, "budget_bytes": budget,
        "device_budget": device_budget, "host_budget": host_budget, "state_over_budget": 16 * n_params / budget,
        "torch_overhead_rss": overhead, "peak_rss": peak, "peak_over_budget_plus_overhead": peak / (budget + overhead),
        "activations_estimate": activations, "engine_device_budget": device_budget - activations,
        "device_peak": rep["device"]["peak"], "staging_peak": rep["host"]["staging_peak"],
        "step_s": times[1:] or times,
        "bytes_read_per_step": d["bytes_read"] // (args.steps - 1),
        "bytes_written_per_step": d["bytes_written"] // (args.steps - 1),
        "train_read_GBps": train_read / 1e9, "train_write_GBps": train_write / 1e9,
        "raw_read_GBps": raw["read"] / 1e9, "raw_write_GBps": raw["write"] / 1e9, "raw_method": raw_before["method"],
        "raw_before_GBps": {k: raw_before[k] / 1e9 for k in ("read", "write")},
        "raw_after_GBps": {k: raw_after[k] / 1e9 for k in ("read", "write")},
        "read_vs_raw": train_read / raw["read"], "write_vs_raw": train_write / raw["write"],
        "disk_time_efficiency": (d["bytes_read"] / raw["read"] + d["bytes_written"] / raw["write"]) / d["busy_s"],
        # Per step: the raw disk's time for the step's bytes read and written at once (mean of the measurements
        # right before and right after the step), over the disk time the tier took for them.
        "mixed_per_step": mixed, "idle_pool_bytes": idle_bytes,
        "mixed_efficiency_same_memory_median": statistics.median(m["efficiency_same"] for m in mixed),
        "mixed_efficiency_fresh_memory_median": statistics.median(m["efficiency_fresh"] for m in mixed),
        "busy_s": d["busy_s"], "kernel_busy_s": kernel_busy if kernel else None,
        # Requests in flight while the disk was busy, by the kernel's count (None: no block device, e.g. tmpfs).
        "mean_queue_depth": sum(q for _, q in kernel) / kernel_busy if kernel_busy else None,
        # Per-direction busy time counting overlap twice (the old, pessimistic time base), for comparison.
        "read_vs_raw_own_busy": d["bytes_read"] / d["read_busy_s"] / raw["read"],
        "write_vs_raw_own_busy": d["bytes_written"] / d["write_busy_s"] / raw["write"],
        "engine_timings": timings,
    }
    shutil.rmtree(folder, ignore_errors=True)
    return out


class _Traffic:
    """Records the NVMe tier's requests (kind, unit, entry, numel, dtype) while `recording` is set."""

    def __init__(self, engine) -> None:
        self.store = engine.stores[Tier.NVME]
        self.ops: list[tuple[str, str, str, int, torch.dtype]] = []
        self.recording = False
        load, save = self.store.load, self.store.save

        def rec_load(unit, entry, dst, urgent=False):
            if self.recording:
                self.ops.append(("r", unit, entry, dst.numel(), dst.dtype))
            return load(unit, entry, dst, urgent)

        def rec_save(unit, entry, src):
            if self.recording:
                self.ops.append(("w", unit, entry, src.numel(), src.dtype))
            return save(unit, entry, src)

        self.store.load, self.store.save = rec_load, rec_save

    def replay(self) -> float:
        """Seconds to move exactly the recorded requests with no compute: all issued at once, in recorded order
        (the store keeps one entry's requests in that order), into buffers allocated beforehand."""
        from tightfit.offload.runtime.aligned import aligned_empty

        bufs = {}
        for _, unit, entry, numel, dtype in self.ops:
            if (unit, entry) not in bufs:
                bufs[(unit, entry)] = aligned_empty(numel, dtype)
        t0 = time.perf_counter()
        futs = [self.store.load(u, e, bufs[(u, e)]) if kind == "r" else self.store.save(u, e, bufs[(u, e)])
                for kind, u, e, _, _ in self.ops]
        for f in futs:
            f.result()
        return time.perf_counter() - t0


def overlap(args) -> dict:
    if args.malloc == "trim":
        _fixed_mmap_threshold()
    _warm_up()
    cfg = _config(args)
    ckpt = [f"blocks.{i}" for i in range(cfg.n_layer)]
    model, opt = _build(cfg, Placement.everywhere(Tier.DEVICE, checkpoint_units=ckpt))
    print("compute only (every state on the device tier):")
    compute = _train(model, opt, cfg, args.batch, args.steps)[1:]
    engine_of(model).close()
    del model, opt
    folder = Path(args.folder) / "overlap"
    shutil.rmtree(folder, ignore_errors=True)
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(folder), prefetch_depth=args.prefetch,
                                     checkpoint_units=ckpt)
    model, opt = _build(cfg, placement, _disk_tuning(args))
    engine = engine_of(model)
    traffic = _Traffic(engine)
    # The I/O-only time of each mode replays the exact requests of its last measured step.
    print("every state on NVMe, optimizer after backward:")
    nvme_after = _train(model, opt, cfg, args.batch, args.steps - 1)[1:]
    traffic.recording = True
    nvme_after += _train(model, opt, cfg, args.batch, 1)
    traffic.recording = False
    engine.wait_writes()
    io_after = [traffic.replay() for _ in range(3)]
    traffic.ops.clear()
    print("every state on NVMe, optimizer during backward (step_during_backward):")
    engine.reset_timings()
    nvme = _train(model, opt, cfg, args.batch, args.steps - 1, early=True)[1:]
    traffic.recording = True
    nvme += _train(model, opt, cfg, args.batch, 1, early=True)
    traffic.recording = False
    timings = engine.timings()
    engine.wait_writes()
    io = [traffic.replay() for _ in range(3)]
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)
    c, n, i = min(compute), min(nvme), min(io)
    med = statistics.median
    return {"compute_step_s": compute, "nvme_step_after_backward_s": nvme_after, "nvme_step_s": nvme,
            "io_only_s": io, "io_only_after_backward_s": io_after, "ratio_best": n / max(c, i),
            "ratio_median": med(nvme) / max(med(compute), med(io)),
            "ratio_after_backward": min(nvme_after) / max(c, min(io_after)),
            "ratio_after_backward_median": med(nvme_after) / max(med(compute), med(io_after)),
            "engine_timings": {k: v for k, v in timings.items() if k != "nvme"}}


def _gpt2_steps(model, opt, steps: int, early: bool, first: int = 0, phases: list | None = None,
                rank: int = 0, world: int = 1, after_step=None) -> list[float]:
    """Step times; `phases`, when given, gets (forward, backward, optimizer step) seconds of each step. Of `world`
    ranks, rank `rank` trains on its own batch of each step. `after_step`: run after each step (the sharded
    optimizer's exchange), timed as the step's."""
    times = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, 50257, (2, 128), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        if early:
            opt.step_during_backward()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        print(f"  step {step}: loss {loss.item():.4f}  {times[-1]:.2f} s (forward {t1 - t0:.2f}, backward "
              f"{t2 - t1:.2f}, step {t3 - t2:.2f})", flush=True)
    return times


def _median_phases(phases: list) -> dict[str, float]:
    return {k: round(statistics.median(p[i] for p in phases), 3) for i, k in enumerate(("forward_s", "backward_s",
                                                                                         "step_s"))}


def gpt2(args) -> dict:
    """tightfit's side of the peer comparison (acceptance 5): HF GPT-2-small (124M, random init), batch 2x128, every
    state on NVMe, fp32 on the CPU. The DeepSpeed ZeRO-3 side is not run by this script; plain PyTorch (the model
    and `torch.optim.AdamW(fused=True)` in memory, no offload) runs after it in the same process, as the compute
    floor.

    Under `torchrun --nproc-per-node N` (gloo): N replicas, each with every state on its own NVMe folder and its own
    batch of each step, the gradients averaged as they leave the device (parallel/replicas.py, as `--strategy ddp
    --offload nvme` runs them); rank 0 reports every rank's step times and peak RSS, and no plain floor runs."""
    import os

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.malloc == "trim":
        _fixed_mmap_threshold()
    _warm_up()
    overhead = psutil.Process().memory_info().rss
    config = GPT2Config(use_cache=False, bos_token_id=0, eos_token_id=0)
    folder = Path(args.folder) / "gpt2" / (f"rank-{rank}" if world > 1 else "")
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    owner, elsewhere = None, ()
    if world > 1 and args.shard != "none":  # ZeRO-1/2 with the engine: each rank steps its own units
        from tightfit.parallel.sharded_optimizer import shard_setup

        owner, elsewhere = shard_setup(model, rank, world, args.shard)
    tightfit.wrap(model, Placement.everywhere(Tier.NVME, nvme_dir=str(folder), prefetch_depth=args.prefetch,
                                             stepped_elsewhere=sorted(elsewhere),
                                             grads_elsewhere=args.shard in ("zero2", "zero3"),
                                             exchanged=sorted(owner) if args.shard == "zero3" else []),
                  device="cpu")
    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    print("tightfit, every state on NVMe:")
    engine = engine_of(model)
    after_step = owners = None
    if world > 1:
        from tightfit.parallel.replicas import average_over_ranks

        averager = average_over_ranks(engine)
        if owner is not None:
            from tightfit.parallel.sharded_optimizer import UnitOwners

            owners = UnitOwners(engine, owner, averager, torch.distributed.new_group(backend="gloo"), args.shard)
            if args.shard == "zero3":  # each use's params from their rank (parallel/params_exchange.py)
                from tightfit.parallel.params_exchange import exchange_params

                exchange_params(engine, owner, torch.distributed.new_group(backend="gloo"))
            else:
                after_step = owners.start  # the exchange beside the next forward
    times = _gpt2_steps(model, opt, 1, early=True, rank=rank, world=world, after_step=after_step)
    engine.reset_timings()
    phases: list = []
    times += _gpt2_steps(model, opt, args.steps - 1, early=True, first=1, phases=phases, rank=rank, world=world,
                         after_step=after_step)
    # The kernel's high-water mark of RSS so far (exact, no sampling thread competing with the hooks for the GIL):
    # the tightfit run is the largest thing this process has done yet. Plain PyTorch runs after it.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if owners is not None:
        owners.join()
    timings = engine.timings()
    engine.close()
    if world > 1:
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, {"step_s": times[1:], "peak_rss": peak,
                                                    "phases_median": _median_phases(phases)})
        torch.distributed.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
        return {"rank": rank, "ranks": ranks, "timings_rank": {k: round(v, 3) for k, v in timings.items()
                                                                 if k != "nvme"}}
    n_params = sum(p.numel() for p in model.parameters())
    del model, opt, engine
    gc.collect()
    shutil.rmtree(folder, ignore_errors=True)
    print("plain PyTorch, in memory:")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    plain_phases: list = []
    plain = _gpt2_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True),
                        args.steps, early=False, phases=plain_phases)
    return {"params": n_params, "plain_step_s": plain[1:], "step_s": times[1:],
            "phases_median": _median_phases(phases), "plain_phases_median": _median_phases(plain_phases[1:]),
            "peak_rss": peak, "torch_overhead_rss": overhead, "over_plain": min(times[1:]) / min(plain[1:]),
            "engine_timings": {k: round(v, 3) for k, v in timings.items() if k != "nvme"},
            "nvme": timings.get("nvme")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["memory", "overlap", "gpt2"])
    ap.add_argument("--folder", default="/tmp/tf_bench", help="swap folder on the disk to use")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--early", action="store_true", help="memory: step units during backward (step_during_backward)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--shard", choices=["none", "zero1", "zero2", "zero3"], default="none",
                    help="gpt2 under torchrun: replicas (none), or each rank the optimizer states (zero1), "
                         "gradients (zero2) and parameters (zero3) of its own units")
    ap.add_argument("--malloc", choices=["trim", "glibc"], default="trim",
                    help="gpt2, overlap: 'trim' pins glibc's mmap threshold (freed buffers go back to the OS at once, "
                         "lower RSS, a page fault per page on every re-allocation); 'glibc' keeps glibc's adaptive "
                         "defaults (the memory benchmark always trims). "
                         "bench_offload_deepspeed.py takes the same flag: compare like with like")
    ap.add_argument("--io-threads", type=int, default=None,
                    help="NVMe tier I/O threads (default: the probe's for this disk, else 8)")
    ap.add_argument("--chunk-kib", type=int, default=None,
                    help="largest NVMe tier transfer, KiB (default: the probe's for this disk, else 4096)")
    ap.add_argument("--min-unit-mib", type=int, default=0,
                    help="memory: join consecutive blocks into units of at least this many MiB (0: one block each)")
    ap.add_argument("--device-mib", type=int, default=40, help="memory: device budget (the CPU here), MiB")
    ap.add_argument("--host-mib", type=int, default=96, help="memory: host budget (staging, optimizer), MiB")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default). 1 by default: on a loaded 2-core VM, OpenMP regions with 2 "
                         "threads stall on every barrier when a thread is descheduled (10x slower steps, seen here)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    out = {"memory": memory, "overlap": overlap, "gpt2": gpt2}[args.what](args)
    out["wall_s"] = time.time() - t0
    if out.get("rank", 0) == 0:  # several ranks (gpt2 under torchrun): rank 0 reports for all
        print(json.dumps(out, indent=2))
    if "rank" in out:  # gloo's threads of the groups left may abort the interpreter's teardown (parallel/mesh.py)
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
