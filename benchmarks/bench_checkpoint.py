"""Checkpoint of an all-NVMe model against a raw copy of the same bytes (issue 17, "Checkpoints that scale").

    .venv/bin/python benchmarks/bench_checkpoint.py --folder /tmp/tf_ckpt_bench            # ~1.0 B parameters
    .venv/bin/python benchmarks/bench_checkpoint.py --folder /tmp/tf_ckpt_bench --layers 4  # a quick ~0.2 B

The reference GPT (n_embd 2048, 20 blocks: 1.01 B parameters) is built on the meta device and wrapped with every
state on NVMe; its fp32 masters and Adam moments are written into the swap files through `import_state` (no
training step: the bytes are what matters here, 12 per parameter). Then, in this order, each from a cold page
cache for the files involved (posix_fadvise DONTNEED on them, which drops only those files' clean pages - the
machine is shared, so nothing global is dropped):

(`--repeats 2`: raw, checkpoint, checkpoint, raw: the load of a shared machine drifts.)

- raw copy: the same byte ranges (every unit's master, exp_avg and exp_avg_sq) copied by a plain read/write loop
  in 16 MiB blocks into one file, fsynced: what `cat a b c > d; sync` costs on this disk;
- tightfit's checkpoint (`checkpoint.start_save` of `checkpoint_swap.state_groups`, as `tightfit train` saves):
  the seconds the trainer is blocked (the copy of each unit's ranges: checkpoint_swap.py) and the seconds
  until the checkpoint is committed (the writer thread has read the copy back for the finiteness check and CRC-32
  and written the index).

Peak extra disk of the checkpoint is its own size (measured: the folder's bytes). The disk needs ~16 B/param of
swap files plus 12 B/param for the checkpoint; the raw copy is deleted before the checkpoint starts. The script
refuses to start when the folder's disk has less free than that plus 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tightfit  # noqa: E402
from tightfit import Placement, Tier  # noqa: E402
from tightfit.models.gpt import GPT, GPTConfig  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402
from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ  # noqa: E402
from tightfit.offload.placement import State  # noqa: E402
from tightfit.offload.model_state.state_io import import_state  # noqa: E402
from tightfit.optim import AdamW  # noqa: E402
from tightfit.train import checkpoint as ckpt  # noqa: E402
from tightfit.train.checkpoint_swap import state_groups  # noqa: E402

GB = 1e9


def _drop_cache(paths) -> None:
    """Drop these files' clean pages from the page cache (only theirs: the machine is shared)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _value(key: str, shape) -> torch.Tensor:
    """Cheap, finite, not all-zero values (a checkpoint's bytes; the values do not matter here)."""
    if key.endswith(".step"):
        return torch.tensor(1.0)
    return torch.full(tuple(shape), 0.02 if key.startswith("model.") else 1e-4)


def _ranges(model) -> list[tuple[Path, int, int]]:
    """(swap file, offset, bytes) of every master and moment entry: what a checkpoint holds."""
    out = []
    for unit in engine_of(model).units.values():
        for state, entry in ((State.MASTER, unit.master_entry), (State.OPTIM, EXP_AVG), (State.OPTIM, EXP_AVG_SQ)):
            store = unit.store[state]
            e = store.nvme.entry(unit.name, entry)
            out.append((store.nvme.path(unit.name), e.offset, e.nbytes))
    return out


def _raw_copy(ranges, dest: Path, block: int = 16 << 20) -> float:
    t0 = time.perf_counter()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(dest, "wb") as out:
        for src, off, n in ranges:
            with open(src, "rb", buffering=0) as f:
                f.seek(off)
                left = n
                while left:
                    got = f.readinto(view[:min(block, left)])
                    out.write(view[:got])
                    left -= got
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True, help="scratch folder (swap files, copies, checkpoint); removed after")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=1, help="measurements of each, in ABBA order")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=16, n_embd=args.embd)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    need = 28 * n_params * 1.1
    free = shutil.disk_usage(folder).free
    if free < need:
        sys.exit(f"{folder}: {free / GB:.1f} GB free, the benchmark needs {need / GB:.1f} GB for "
                 f"{n_params / 1e9:.2f} B parameters; use --layers to shrink the model")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    tightfit.wrap(model, Placement.everywhere(Tier.NVME, nvme_dir=str(folder / "swap")), device="cpu")
    opt = AdamW(model.parameters(), lr=1e-4)

    def get(key: str) -> torch.Tensor:
        name = key[len("model."):] if key.startswith("model.") else key[len("optim."):].rsplit(".", 1)[0]
        return _value(key, shapes[name])

    import_state(model, opt, get)
    engine = engine_of(model)
    engine.wait_writes()
    setup_s = time.perf_counter() - t0
    ranges = _ranges(model)
    ckpt_bytes = sum(n for _, _, n in ranges)
    swap_files = sorted({src for src, _, _ in ranges})
    print(f"{n_params / 1e9:.3f} B parameters, {len(engine.units)} units, swap files "
          f"{sum(p.stat().st_size for p in swap_files) / GB:.1f} GB, checkpoint data {ckpt_bytes / GB:.2f} GB "
          f"(setup {setup_s:.0f} s)", flush=True)

    raws, blocked, commits, loads, written = [], [], [], [], 0
    for r in range(args.repeats):  # ABBA order: raw, checkpoint, checkpoint, raw, ... (load drifts on this machine)
        for what in (("raw", "ckpt") if r % 2 == 0 else ("ckpt", "raw")):
            _drop_cache(swap_files)
            loads.append(os.getloadavg()[0])
            if what == "raw":
                raw_file = folder / "raw.bin"
                raws.append(_raw_copy(ranges, raw_file))
                raw_file.unlink()
                print(f"raw copy (read/write 16 MiB blocks, fsync): {raws[-1]:.1f} s, "
                      f"{ckpt_bytes / raws[-1] / GB:.2f} GB/s (load {loads[-1]:.1f})", flush=True)
                continue
            rng = {ckpt.RNG_TORCH: torch.get_rng_state(), ckpt.RNG_DATA: torch.Generator().get_state()}
            t0 = time.perf_counter()
            writer = ckpt.start_save(folder / "checkpoints", state_groups(model, opt), step=1, config={},
                                     signature="", rng=rng)
            blocked.append(time.perf_counter() - t0)
            path = writer.wait()
            commits.append(time.perf_counter() - t0)
            written = sum(p.stat().st_size for p in path.iterdir())
            print(f"tightfit checkpoint: trainer blocked {blocked[-1]:.1f} s (the copy), committed after "
                  f"{commits[-1]:.1f} s (check + CRC-32 of the copy on the writer thread); {written / GB:.2f} GB on "
                  f"disk (load {loads[-1]:.1f})", flush=True)
            shutil.rmtree(path)
    result = {"params": n_params, "units": len(engine.units), "checkpoint_data_bytes": ckpt_bytes,
              "checkpoint_disk_bytes": written, "setup_s": setup_s, "raw_copy_s": raws,
              "checkpoint_blocked_s": blocked, "checkpoint_commit_s": commits,
              "blocked_over_raw": sum(blocked) / sum(raws), "commit_over_raw": sum(commits) / sum(raws),
              "loadavg_1min": loads, "cpus": os.cpu_count(), "machine": platform.node(),
              "kernel": platform.release(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
