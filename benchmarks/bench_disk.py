"""NVMe tier vs raw disk: sequential O_DIRECT write+read of N MiB, then the same volume through NvmeStore.

Why: the tier must reach >= 85% of what the disk itself delivers. Both are measured in the same run, interleaved
(raw, store, raw, store, ...) through the same host memory, so background load on a shared machine and the
memory's behaviour hit both alike. The raw figure of a round is the best over the queue depths tried (fio when
installed, otherwise the Python O_DIRECT loop of disk_bench.py). Two ratios per direction: best store / best
raw, and the median over rounds of store / raw within a round (the side-by-side figure, least sensitive to load
that comes and goes).

    .venv/bin/python benchmarks/bench_disk.py --folder /tmp --mib 1024 --repeats 3

--gil-busy runs a thread executing Python bytecode throughout (as a training loop's hooks and bookkeeping do),
and --backend both measures the store's two ways of moving O_DIRECT transfers side by side: I/O threads
(preadv/pwrite, each needing the GIL to start its next transfer) and native AIO (aio.py).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tightfit.offload.disk_bench import measure_raw, measure_store, staging_buffer  # noqa: E402

GB = 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=tempfile.gettempdir(), help="folder on the disk to measure")
    ap.add_argument("--mib", type=int, default=1024, help="volume written then read per measurement (MiB)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved raw/store rounds")
    ap.add_argument("--queue-depths", default="1,8", help="raw: requests in flight to try (best one counts)")
    ap.add_argument("--block-mib", type=int, default=4, help="raw: block size (MiB)")
    ap.add_argument("--threads", type=int, default=8, help="store: I/O threads")
    ap.add_argument("--chunk-mib", type=int, default=4, help="store: chunk size (MiB)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="store: size of each tensor (MiB)")
    ap.add_argument("--no-fio", action="store_true", help="use the Python O_DIRECT loop even if fio is installed")
    ap.add_argument("--backend", choices=["default", "threads", "aio", "both"], default="default",
                    help="store: how O_DIRECT transfers move (default: AIO where the kernel has it)")
    ap.add_argument("--gil-busy", action="store_true", help="a thread runs Python bytecode during every measurement")
    args = ap.parse_args()
    backends = {"default": [("store", None)], "threads": [("threads", False)], "aio": [("aio", True)],
                "both": [("threads", False), ("aio", True)]}[args.backend]
    stop = threading.Event()
    if args.gil_busy:
        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        threading.Thread(target=spin, daemon=True).start()
    nbytes = args.mib << 20
    qds = [int(q) for q in args.queue_depths.split(",")]

    raw_runs: list[dict[str, float]] = []  # per round: best raw over the queue depths, per direction
    store_runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in backends}
    method = "?"
    # One host buffer for both measurements, so they move data through the same (aligned, faulted-in) memory.
    staging = staging_buffer(nbytes)
    print(f"folder {args.folder}, {args.mib} MiB per measurement, {platform.node()}")
    for r in range(args.repeats):
        best = {"read": 0.0, "write": 0.0}
        for qd in qds:
            raw = measure_raw(args.folder, nbytes, block_bytes=args.block_mib << 20, queue_depth=qd,
                              use_fio=not args.no_fio, staging=staging)
            method = raw.method
            print(f"round {r} raw   ({raw.method}, QD {qd:>2}): write {raw.write_Bps / GB:6.2f} GB/s  "
                  f"read {raw.read_Bps / GB:6.2f} GB/s")
            best = {"write": max(best["write"], raw.write_Bps), "read": max(best["read"], raw.read_Bps)}
        raw_runs.append(best)
        for label, aio in backends:
            st = measure_store(args.folder, nbytes, tensor_bytes=args.tensor_mib << 20, threads=args.threads,
                               chunk_bytes=args.chunk_mib << 20, staging=staging, aio=aio)
            print(f"round {r} {label} ({st.method}, {args.threads} in flight): write {st.write_Bps / GB:6.2f} GB/s  "
                  f"read {st.read_Bps / GB:6.2f} GB/s")
            store_runs[label].append({"write": st.write_Bps, "read": st.read_Bps})
    stop.set()

    print()
    print("| store | direction | raw best (GB/s) | store best (GB/s) | best / best | median of per-round store / raw |")
    print("|---|---|---|---|---|---|")
    for label, runs in store_runs.items():
        for d in ("write", "read"):
            raw_best = max(x[d] for x in raw_runs)
            store_best = max(x[d] for x in runs)
            ratio = statistics.median(s[d] / r[d] for s, r in zip(runs, raw_runs))
            print(f"| {label} | {d} | {raw_best / GB:.2f} ({method}) | {store_best / GB:.2f} | "
                  f"{store_best / raw_best:.0%} | {ratio:.0%} |")


if __name__ == "__main__":
    main()
