"""NVMe tier vs raw disk: sequential O_DIRECT write+read of N MiB, then the same volume through NvmeStore.

Why: the tier must reach >= 85% of what the disk itself delivers. Both are measured in the same run, interleaved
(raw, store, raw, store, ...) through the same host memory, so background load on a shared machine and the
memory's behaviour hit both alike. The raw figure of a round is the best over the queue depths tried (fio when
installed, otherwise the probe's Python O_DIRECT loop; disk_reference.py). Two ratios per direction: best store /
best raw, and the median over rounds of store / raw within a round (the side-by-side figure, least sensitive to
load that comes and goes). The store runs with the tuning the tier derives for the folder (the probe's, else 8
threads and 4 MiB transfers) unless --threads / --chunk-kib say otherwise.

    .venv/bin/python benchmarks/bench_disk.py --folder /tmp --mib 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tightfit.offload.tiers.nvme.store import DiskTuning, disk_tuning  # noqa: E402

from disk_reference import measure_raw, measure_store, staging_buffer  # noqa: E402

GB = 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=tempfile.gettempdir(), help="folder on the disk to measure")
    ap.add_argument("--mib", type=int, default=1024, help="volume written then read per measurement (MiB)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved raw/store rounds")
    ap.add_argument("--queue-depths", default="1,8", help="raw: requests in flight to try (best one counts)")
    ap.add_argument("--block-mib", type=int, default=4, help="raw: block size (MiB)")
    ap.add_argument("--threads", type=int, default=None,
                    help="store: I/O threads (default: the probe's for this disk, else 8)")
    ap.add_argument("--chunk-kib", type=int, default=None,
                    help="store: largest transfer, KiB (default: the probe's for this disk, else 4096)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="store: size of each tensor (MiB)")
    ap.add_argument("--no-fio", action="store_true", help="use the Python O_DIRECT loop even if fio is installed")
    args = ap.parse_args()
    nbytes = args.mib << 20
    qds = [int(q) for q in args.queue_depths.split(",")]

    raw_runs: list[dict[str, float]] = []  # per round: best raw over the queue depths, per direction
    store_runs: list[dict[str, float]] = []
    method = "?"
    # One host buffer for both measurements, so they move data through the same (aligned, faulted-in) memory.
    staging = staging_buffer(nbytes)
    tuning = disk_tuning(args.folder)
    tuning = DiskTuning(args.threads or tuning.threads,
                        tuning.chunk_bytes if args.chunk_kib is None else args.chunk_kib << 10)
    print(f"folder {args.folder}, {args.mib} MiB per measurement, {platform.node()}; store: {tuning.threads} "
          f"threads, transfers up to {tuning.chunk_bytes >> 10} KiB")
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
        st = measure_store(args.folder, nbytes, tensor_bytes=args.tensor_mib << 20, threads=tuning.threads,
                           chunk_bytes=tuning.chunk_bytes, staging=staging)
        print(f"round {r} store ({st.method}, {tuning.threads} threads): write {st.write_Bps / GB:6.2f} GB/s  "
              f"read {st.read_Bps / GB:6.2f} GB/s")
        store_runs.append({"write": st.write_Bps, "read": st.read_Bps})

    print()
    print("| direction | raw best (GB/s) | store best (GB/s) | best / best | median of per-round store / raw |")
    print("|---|---|---|---|---|")
    for d in ("write", "read"):
        raw_best = max(x[d] for x in raw_runs)
        store_best = max(x[d] for x in store_runs)
        ratio = statistics.median(s[d] / r[d] for s, r in zip(store_runs, raw_runs))
        print(f"| {d} | {raw_best / GB:.2f} ({method}) | {store_best / GB:.2f} | {store_best / raw_best:.0%} | "
              f"{ratio:.0%} |")


if __name__ == "__main__":
    main()
