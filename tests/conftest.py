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


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    """A tiny random Llama (2 layers, width 32, vocab 256, untied head) saved as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder
