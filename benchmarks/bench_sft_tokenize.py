"""Tokenizing fine-tuning records: tightfit's token cache against `datasets.map` (TRL's way), and a fine-tune of a
corpus larger than its host-memory budget.

    .venv/bin/python benchmarks/bench_sft_tokenize.py [--mb 64] [--format prompt-completion|messages|text]
    .venv/bin/python benchmarks/bench_sft_tokenize.py --mb 2048 --train --cpu-mem 1GiB   # the larger-than-RAM run

Each measurement runs in a fresh process (wall time and peak RSS of that process alone), on one JSONL file of
`--mb` MB of records written from the Python standard library's text, with a byte-level BPE trained offline on 1 MB
of it (tests/tokenizer_helpers.py; a ChatML template for messages):
- tightfit: `tokenize_records` (finetune/token_cache.py), records read and encoded a thousand to a call, ids
  written to the memory-mapped cache;
- datasets: `load_dataset("json")` then `.map` of TRL's own tokenization (SFTTrainer's `tokenize_fn` shape: the
  prompt, and prompt + completion, through `tokenizer(text)`; `apply_chat_template` for messages), batched=False as
  TRL calls it, into datasets' own arrow cache; and the same map with batched=True (the fastest `datasets.map` can
  be), for the record.
With `--train`: `tightfit train` on the records, a 2-layer Llama of the tokenizer's vocabulary, `--cpu-mem` as given,
20 steps; its peak RSS against the budget and the plan's prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TIGHTFIT = """
import json, resource, sys, time
from pathlib import Path
from tightfit.models.tokenizer import get_tokenizer
from tightfit.finetune.token_cache import tokenize_records
t = time.perf_counter()
ex = tokenize_records([Path(sys.argv[1])], Path(sys.argv[3]), get_tokenizer(sys.argv[2]))
print(json.dumps({"wall_s": time.perf_counter() - t, "examples": len(ex), "tokens": int(ex.offsets[-1]),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

DATASETS = """
import json, resource, sys, time
import datasets, transformers
datasets.disable_progress_bars()
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[2])
batched = sys.argv[4] == "batched"
t = time.perf_counter()
ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
eos = tok.eos_token
def one(ex):
    if "messages" in ex:
        return {"input_ids": tok.apply_chat_template(ex["messages"], tokenize=True, return_dict=True)["input_ids"]}
    if "prompt" in ex:
        p = tok(text=ex["prompt"])["input_ids"]
        return {"input_ids": tok(text=ex["prompt"] + ex["completion"] + eos)["input_ids"], "prompt_ids": p}
    return {"input_ids": tok(text=ex["text"] + eos)["input_ids"]}
def many(b):
    if "prompt" in b:
        return {"input_ids": tok(text=[p + c + eos for p, c in zip(b["prompt"], b["completion"])])["input_ids"],
                "prompt_ids": tok(text=b["prompt"])["input_ids"]}
    if "text" in b:
        return {"input_ids": tok(text=[x + eos for x in b["text"]])["input_ids"]}
    return {"input_ids": [tok.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in b["messages"]]}
out = ds.map(many if batched else one, batched=batched)
n = sum(len(x) for x in out["input_ids"])
print(json.dumps({"wall_s": time.perf_counter() - t, "examples": len(out), "tokens": n,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_records(path: Path, mb: float, fmt: str) -> int:
    from tightfit.train.data import stdlib_files

    lines = []
    for f in stdlib_files()[:400]:
        lines.extend(x for x in f.read_text(errors="replace").splitlines() if x.strip())
    rng = random.Random(0)
    size = 0
    with open(path, "w") as out:
        while size < mb * 1e6:
            a = "\n".join(rng.choice(lines) for _ in range(rng.randint(2, 12)))
            b = "\n".join(rng.choice(lines) for _ in range(rng.randint(2, 12)))
            rec = ({"prompt": a, "completion": b} if fmt == "prompt-completion" else {"text": a + "\n" + b}
                   if fmt == "text" else {"messages": [{"role": "user", "content": a},
                                                       {"role": "assistant", "content": b}]})
            line = json.dumps(rec) + "\n"
            out.write(line)
            size += len(line)
    return size


def child(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--format", choices=["prompt-completion", "messages", "text"], default="prompt-completion")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--cpu-mem", default="1GiB")
    ap.add_argument("--skip-datasets", action="store_true")
    ap.add_argument("--json-out", default=None, help="also write the figures to this JSON file (benchmarks/results/, "
                                                     "read by benchmarks/summary.py)")
    ap.add_argument("--section", default="", help="the RESULTS.md section (its anchor) the figures are recorded in")
    args = ap.parse_args()
    import tokenizer_helpers
    from tightfit.train.data import stdlib_files

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        text = "".join(f.read_text(errors="replace") for f in stdlib_files()[:200])[:1_000_000]
        folder = tokenizer_helpers.byte_level(tmp / "tok", text)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHATML
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        data = tmp / "records.jsonl"
        t = time.perf_counter()
        size = write_records(data, args.mb, args.format)
        print(f"records: {size / 1e6:.1f} MB of {args.format} JSONL written in {time.perf_counter() - t:.1f} s")
        rows = {"tightfit": child(TIGHTFIT, str(data), str(folder), str(tmp / "cache"))}
        if not args.skip_datasets:
            rows["datasets.map (TRL's, batched=False)"] = child(DATASETS, str(data), str(folder), str(tmp / "hf1"),
                                                                "single")
            rows["datasets.map (batched=True)"] = child(DATASETS, str(data), str(folder), str(tmp / "hf2"),
                                                        "batched")
        base = rows["tightfit"]["wall_s"]
        for name, r in rows.items():
            print(f"{name:38s} {r['wall_s']:7.1f} s  {size / 1e6 / r['wall_s']:6.2f} MB/s  {r['examples']:>9,} "
                  f"examples {r['tokens']:>12,} tokens  peak RSS {r['peak_rss_mib']:7.0f} MiB  "
                  f"({r['wall_s'] / base:.2f}x tightfit's time)")
        import datetime
        import platform

        import psutil
        import torch

        record = {"benchmark": "bench_sft_tokenize", "format": args.format, "mb": size / 1e6, "rows": rows,
                  "figure": f"{size / 1e6:.0f} MB of {args.format} JSONL records, a byte-level BPE",
                  "command": "benchmarks/bench_sft_tokenize.py " + " ".join(sys.argv[1:]),
                  "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), "
                             f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}",
                  "date": datetime.date.today().isoformat(), "section": args.section}
        if args.train:
            record["train"] = train(tmp, folder, data, args.cpu_mem)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(record, indent=1))


def train(tmp: Path, tok_folder: Path, data: Path, cpu_mem: str) -> None:
    import shutil

    import sft_helpers

    from tightfit.models.tokenizer import get_tokenizer

    model = tmp / "llama"
    shutil.copytree(tok_folder, model)
    sft_helpers.make_llama(model, vocab=get_tokenizer(str(tok_folder)).vocab_size, seq=512)
    out = tmp / "run"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", "--model", f"hf:{model}", "--data",
                           str(data), "--seq-len", "512", "--micro-batch", "4", "--steps", "20", "--cpu-mem", cpu_mem,
                           "--offload", "host", "--log-interval", "10", "--eval-interval", "20", "--eval-batches", "2",
                           "--tensorboard", "off", "--keep-checkpoints", "0", "--out-dir", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    summary = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    plan = next((r for r in summary if r.get("kind") == "plan_vs_measured"), {})
    print(f"train: exit {proc.returncode} in {time.perf_counter() - t:.0f} s; plan vs measured: "
          f"{json.dumps({k: v for k, v in plan.items() if k in ('predicted', 'measured')})}")
    return {"exit": proc.returncode, "seconds": time.perf_counter() - t, "cpu_mem": cpu_mem,
            "plan_vs_measured": plan, "stdout_tail": proc.stdout[-1500:]}


if __name__ == "__main__":
    main()
