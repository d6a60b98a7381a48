"""One training loop for every world size (tightfit/train/loop.py): a process group runs the loop one process runs,
in a `GroupWorld` (tightfit/parallel/world.py), so what the loop does, a group does too.

Each test names what a group's own loop (tightfit/parallel/run.py's, before there was one) did not do.
"""

from __future__ import annotations

import json
import subprocess
import sys

from parallel_launch import ROOT, free_port, rank_env


def _group(tiny_args, *extra: str, ranks: int = 2, strategy: str = "ddp") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--nproc-per-node", str(ranks),
                           "--master-port", str(free_port()), "--strategy", strategy, *extra],
                          env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_a_group_keeps_no_checkpoint_profiles_and_logs_like_one_process(tiny_args, tmp_path):
    """`--keep-checkpoints 0` (a group's loop wrote one anyway), `--profile DIR` (ignored: rank 0 now records its
    steps), and the one-process summary record in metrics.jsonl (the strategy and the mesh beside it)."""
    out = tmp_path / "run"
    proc = _group(tiny_args, "--steps", "5", "--keep-checkpoints", "0", "--profile", str(tmp_path / "prof"),
                  strategy="zero3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: none (--keep-checkpoints 0)" in proc.stdout
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert (tmp_path / "prof" / "profile_trace.json").is_file(), proc.stdout[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in records if r["kind"] == "summary"]
    assert len(summary) == 1  # rank 0 writes the metrics
    assert summary[0]["strategy"] == "zero3" and summary[0]["ranks"] == 2 and summary[0]["steps"] == 5
    assert summary[0]["tokens_per_s"] > 0 and summary[0]["peak_memory"]["rss"] > 0
