"""Where the NVMe tier's disk time goes in training: one recorded step's exact requests, four ways.

    .venv/bin/python benchmarks/bench_nvme_decompose.py                      # the memory benchmark's model and budgets
    .venv/bin/python benchmarks/bench_nvme_decompose.py --device-mib 400 --host-mib 640   # with room

Why: the memory benchmark's 7 MB units under its small budget reach only 0.65-0.82 of raw (benchmarks/RESULTS.md).
For each measured step (every state on NVMe, step during backward, the memory benchmark's model) this puts four
times side by side for the same bytes:
- train: the tier's disk time during the step (wall time with at least one chunk in flight, NvmeStore.stats);
- store replay: the step's recorded requests through the same store, all issued at once, no compute;
- raw, same layout: the same requests as raw preadv/pwritev on the tier's own files, offsets and transfer pieces
  (NvmeStore._plan), 8 threads, huge-page buffers, all at once, without the store's ordering of requests on the
  same entry (a read after a write of that entry waits for it in the store; here it does not);
- raw, sequential: the same read and write volume as sequential O_DIRECT blocks, 4 + 4 in flight (RawMixedDisk),
  the memory benchmark's reference.
Also the kernel's own busy time for the block device (/proc/diskstats io_ticks) next to the tier's (a chunk counts
as in flight until its I/O thread has the GIL again, so the tier's count can exceed the time the device was busy),
and the mean number of requests in flight while the device was busy, in training and in the replay, by the
kernel's count (time_in_queue / io_ticks). That column used to split the tier's disk time by chunks in flight
from a per-depth histogram the store kept; the histogram left the store's I/O path (issue 15), and the kernel's
counters give the mean depth instead (no split by depth).
Their ratios split the shortfall into the layout (sequential / same layout), the store's code path (same layout /
store replay) and the schedule of training (store replay / train): the bursts in which a step's requests reach the
disk as compute goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import bench_offload as bo  # noqa: E402
from disk_reference import RawMixedDisk, kernel_disk_stats  # noqa: E402
from tightfit import Placement, Tier  # noqa: E402
from tightfit.models.gpt import GPT  # noqa: E402
from tightfit.offload.runtime.aligned import aligned_empty  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402
from tightfit.planner.costs import act_bytes  # noqa: E402
from tightfit.planner.model_profile import profile_model  # noqa: E402


def _raw_same_layout(store, ops, pool: ThreadPoolExecutor, bufs: dict) -> float:
    """Seconds for `ops` as raw transfers on the tier's own files, cut as the store cuts them, all at once."""
    futs = []
    t0 = time.perf_counter()
    for kind, unit, entry, _numel, _dtype in ops:
        f = store._files[unit]
        e = f.entries[entry]
        if e.nbytes not in bufs:
            bufs[e.nbytes] = aligned_empty(e.nbytes, torch.uint8)
        buf = bufs[e.nbytes]
        mv = memoryview(buf.numpy())
        for start, n, direct in store._plan(f, e, buf.data_ptr()):
            fn = os.preadv if kind == "r" else os.pwritev
            futs.append(pool.submit(fn, f.dfd if direct else f.fd, [mv[start:start + n]], e.offset + start))
    wait(futs)
    seconds = time.perf_counter() - t0
    errors = [x.exception() for x in futs if x.exception() is not None]
    if errors:
        raise errors[0]
    return seconds


def _depth(k0: tuple[float, float] | None, k1: tuple[float, float] | None) -> str:
    """The kernel's mean requests in flight while the device was busy between two samples of kernel_disk_stats."""
    if k0 is None or k1 is None or k1[0] <= k0[0]:
        return "n/a"
    return f"{(k1[1] - k0[1]) / (k1[0] - k0[0]):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="/tmp/tf_bench")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="steps; the first two are not measured")
    ap.add_argument("--device-mib", type=int, default=40)
    ap.add_argument("--host-mib", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bo._fixed_mmap_threshold()
    bo._warm_up()
    cfg = bo._config(args)
    ckpt = [f"blocks.{i}" for i in range(cfg.n_layer)]
    with torch.device("meta"):
        activations = act_bytes(profile_model(GPT(cfg), args.batch, args.seq), set(ckpt))
    folder = Path(args.folder) / "decompose"
    shutil.rmtree(folder, ignore_errors=True)
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(folder), prefetch_depth=2, checkpoint_units=ckpt,
                                     device_budget=(args.device_mib << 20) - activations,
                                     host_budget=args.host_mib << 20)
    model, opt = bo._build(cfg, placement)
    engine = engine_of(model)
    traffic = bo._Traffic(engine)
    store = engine.stores[Tier.NVME].nvme
    (folder / "raw").mkdir(parents=True, exist_ok=True)
    sequential = RawMixedDisk(folder / "raw")
    pool, bufs = ThreadPoolExecutor(8), {}
    for step in range(args.steps):
        traffic.ops.clear()
        traffic.recording = step >= 2
        before, k0 = store.stats(), kernel_disk_stats(folder)
        bo._train(model, opt, cfg, args.batch, 1, early=True)
        engine.wait_writes()
        traffic.recording = False
        after, k1 = store.stats(), kernel_disk_stats(folder)
        if step < 2:
            continue
        busy = after["busy_s"] - before["busy_s"]
        read = after["bytes_read"] - before["bytes_read"]
        written = after["bytes_written"] - before["bytes_written"]
        s_replay, k2 = store.stats(), kernel_disk_stats(folder)
        replay = traffic.replay()
        s_end, k3 = store.stats(), kernel_disk_stats(folder)
        replay = min(replay, traffic.replay())
        layout = min(_raw_same_layout(store, traffic.ops, pool, bufs) for _ in range(2))
        seq = sequential.seconds(read, written)
        print(f"step {step}: {read / 1e9:.2f} GB read, {written / 1e9:.2f} GB written | seconds: train {busy:.2f}, "
              f"store replay {replay:.2f}, raw same layout {layout:.2f}, raw sequential {seq:.2f} | "
              f"sequential/train {seq / busy:.2f} = layout {seq / layout:.2f} x store {layout / replay:.2f} x "
              f"schedule {replay / busy:.2f}", flush=True)
        if k0 is not None:
            print(f"  the kernel's busy time for the device (io_ticks): train {k1[0] - k0[0]:.2f} s against the "
                  f"tier's {busy:.2f} s; store replay {k3[0] - k2[0]:.2f} s against "
                  f"{s_end['busy_s'] - s_replay['busy_s']:.2f} s; requests in flight while busy (the kernel's "
                  f"mean): train {_depth(k0, k1)}, store replay {_depth(k2, k3)}", flush=True)
    pool.shutdown()
    sequential.close()
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
