"""Peer comparison (issue 3 acceptance 5): DeepSpeed ZeRO-3 with parameters and optimizer states on NVMe, on CPU.

The same workload as `bench_offload.py gpt2`: HF GPT-2-small (124M, random init), batch 2x128, fp32, AdamW, every
state on NVMe. DeepSpeed stays out of tightfit's dependencies: install it beside the project and point
PYTHONPATH at it (it needs Debian's libaio-dev for its async I/O, and compiles its CPU Adam and AIO ops on first
use with ninja and g++):

    apt-get install -y libaio-dev
    .venv/bin/pip install --target /tmp/dspkgs --no-deps deepspeed hjson py-cpuinfo msgpack einops ninja
    PYTHONPATH=/tmp/dspkgs DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_offload_deepspeed.py --folder /tmp/tf_bench

Under `torchrun --nproc-per-node N` (gloo) each rank trains on its own batch of the same shape (so a step is N
batches), its NVMe files in a folder of its own; rank 0 prints every rank's step times and peak RSS:

    PYTHONPATH=/tmp/dspkgs DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc-per-node 2 \
        benchmarks/bench_offload_deepspeed.py --folder /tmp/tf_bench

DeepSpeed's NVMe parameter offload needs `stage3_max_live_parameters`, `stage3_prefetch_bucket_size` and
`stage3_max_reuse_distance` near 1e7, and `offload_param.buffer_count` >= 16 with buffers as large as the largest
parameter (the 38.6M-element tied embedding), to run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29517"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import resource  # noqa: E402

from bench_offload import _fixed_mmap_threshold  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="/tmp/tf_bench")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--malloc", choices=["trim", "glibc"], default="trim", help="as in bench_offload.py")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.malloc == "trim":
        _fixed_mmap_threshold()
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = Path(args.folder) / "deepspeed" / f"rank-{rank}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(folder), "buffer_count": 16,
                              "buffer_size": 4e7, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(folder), "buffer_count": 4},
            "stage3_max_live_parameters": 1e7,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_max_reuse_distance": 1e7,
            "stage3_param_persistence_threshold": 1e4,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT2LMHeadModel(GPT2Config(use_cache=False, bos_token_id=0, eos_token_id=0))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    times = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, 50257, (2, 128), generator=g)
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        print(f"  step {step}: loss {loss.item():.4f}  {times[-1]:.2f} s", flush=True)
    # The kernel's high-water mark of this process's RSS (exact, and no sampling thread competing for the GIL).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ranks = [None] * world
    torch.distributed.all_gather_object(ranks, {"step_s": times[1:], "peak_rss": peak})
    if rank == 0:
        print(json.dumps(ranks[0] if world == 1 else {"ranks": ranks}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
