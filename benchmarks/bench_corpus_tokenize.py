"""Loading a text corpus through a Hugging Face tokenizer: peak RSS and wall time of `load_tokens`, in a fresh process.

    .venv/bin/python benchmarks/bench_corpus_tokenize.py [--mb 50] [--kind byte_level|metaspace] [--code DIR ...]

Why: the corpus is in RAM for the whole run at 4 bytes a token, but encoding it in one call held the text, the
tokenizer's encoding and a Python list of ids at once (train/corpus_encoding.py). The corpus is the Python standard
library's sources, repeated to `--mb` MB, in files; the tokenizer is trained offline on 1 MB of it
(tests/tokenizer_helpers.py). Each `--code` folder (a worktree of another commit) is measured in turn on the same
files; the ids' digest says whether two codes load the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHILD = """
import hashlib, json, resource, sys, time
from tightfit.models.tokenizer import get_tokenizer
from tightfit.train.data import load_tokens
tok = get_tokenizer(sys.argv[2])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
ids = load_tokens(sys.argv[1], tok)
wall = time.perf_counter() - t
print(json.dumps({"tokens": int(len(ids)), "wall_s": wall, "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mib": base / 1024, "ids_mib": ids.nbytes / 2**20,
    "digest": hashlib.sha256(ids.tobytes()).hexdigest()[:16]}))
"""


def corpus(folder: Path, mb: float) -> int:
    from tightfit.train.data import stdlib_files

    files, total, i = stdlib_files(), 0, 0
    while total < mb * 1e6:
        text = files[i % len(files)].read_bytes()
        (folder / f"{i:06d}.txt").write_bytes(text)
        total, i = total + len(text), i + 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--kind", choices=["byte_level", "metaspace"], default="byte_level")
    ap.add_argument("--code", action="append", default=[], help="a folder whose tightfit to measure (default: this)")
    args = ap.parse_args()
    import tokenizer_helpers

    from tightfit.train.data import stdlib_files

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        size = corpus(tmp / "corpus", args.mb)
        train = "\n".join(f.read_text(errors="replace") for f in stdlib_files()[:200])[:1_000_000]
        tok = getattr(tokenizer_helpers, args.kind)(tmp / "tok", train, vocab=8000)
        for code in args.code or [str(ROOT)]:
            env = dict(os.environ, PYTHONPATH=code)
            out = subprocess.run([sys.executable, "-c", CHILD, str(tmp / "corpus"), str(tok)], env=env, cwd=tmp,
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"code": code, "kind": args.kind, "corpus_mb": size / 1e6, **row}))


if __name__ == "__main__":
    main()
