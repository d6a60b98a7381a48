"""The examples run end to end (few steps here; their default lengths are for people, and take < 1 min on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
# Each spawns a fresh interpreter (torch + transformers imports dominate): ~5 s of CPU each, but 20 s and more of
# wall time on a loaded machine, so they stay out of the default suite.
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_finetune_hf_llama(tmp_path):
    out = _run("finetune_hf_llama.py", "--steps", "3", "--out", str(tmp_path / "ft"))
    assert "same logits" in out and (tmp_path / "ft" / "config.json").exists()
    assert (tmp_path / "ft" / "model.safetensors.index.json").exists()


def test_wrap_plain_torch():
    out = _run("wrap_plain_torch.py", "--steps", "3")
    assert "encoder units: ['root', 'layers.0', 'layers.1', 'layers.2', 'layers.3']" in out
    assert "mlp units: ['root', '0', '2', '4']" in out
