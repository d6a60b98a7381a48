"""Shared fixtures: a small text corpus and the flags of a tiny, fast training run."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

# Every engine in the test suite uses the strict CPU mover: copies complete late, on their own threads, and a buffer
# freed, reused or read while a copy touches it fails loudly ([Note: the mover contract],
# tightfit/offload/runtime/movers.py).
# Subprocesses the tests start inherit it.
os.environ.setdefault("TIGHTFIT_STRICT_MOVER", "1")


TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--micro-batch", "4", "--eval-interval",
        "5", "--eval-batches", "2", "--log-interval", "5", "--warmup-steps", "2", "--threads", "1"]
"""The flags of `tiny_args` after --data and --out-dir."""


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~60 KB of deterministic pseudo-English text in a folder of two files."""
    rng = random.Random(0)
    words = ["the", "model", "fits", "memory", "tensor", "disk", "train", "step", "loss", "falls", "and", "on"]
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(2):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(500))
        (folder / f"part{i}.txt").write_text(text)
    return folder


@pytest.fixture
def tiny_args(corpus, tmp_path) -> list[str]:
    """Flags for a run of a few seconds on CPU."""
    return ["--data", str(corpus), "--out-dir", str(tmp_path / "run"), *TINY]
