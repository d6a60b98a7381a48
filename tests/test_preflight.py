"""Every path a run writes is checked before its first step (tightfit/train/preflight.py; issue 27): each bad one is
one line naming its flag, exit 2, before any training, and nothing on disk is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _train(tiny_args: list[str], *extra: str, out: Path | str | None = None) -> subprocess.CompletedProcess:
    args = list(tiny_args)
    if out is not None:
        args[args.index("--out-dir") + 1] = str(out)  # a str as it is: "" stays empty
    return subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", "3", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tightfit: error: ") and "Traceback" not in proc.stderr, lines
    assert "training" not in proc.stdout and "step " not in proc.stdout, "refused only after it started"
    return lines[0]


def test_checkpoints_that_is_a_file_is_refused_before_training(tiny_args, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("mine")
    assert "--out-dir (checkpoints/)" in _one_line(_train(tiny_args, out=out))
    assert (out / "checkpoints").read_text() == "mine"


def test_metrics_that_is_a_folder_or_a_symlink_is_refused(tiny_args, tmp_path):
    out = tmp_path / "run"
    (out / "metrics.jsonl").mkdir(parents=True)
    assert "metrics.jsonl" in _one_line(_train(tiny_args, out=out))
    other = tmp_path / "elsewhere.txt"
    other.write_text("not yours\n")
    out2 = tmp_path / "run2"
    out2.mkdir()
    (out2 / "metrics.jsonl").symlink_to(other)
    err = _one_line(_train(tiny_args, out=out2))
    assert "symbolic link" in err and "metrics.jsonl" in err
    assert other.read_text() == "not yours\n"


def test_tensorboard_that_is_a_file_and_an_empty_out_dir_are_refused(tiny_args, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("x")
    assert "--out-dir (tensorboard/)" in _one_line(_train(tiny_args, "--tensorboard", "on", out=out))
    assert "--out-dir: empty" in _one_line(_train(tiny_args, out=""))


@pytest.mark.parametrize("flag", ["--export-hf", "--profile", "--trace"])
def test_an_output_folder_under_a_file_or_that_is_a_file_is_refused(tiny_args, tmp_path, flag):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert flag in _one_line(_train(tiny_args, flag, str(blocker / "sub")))
    assert flag in _one_line(_train(tiny_args, flag, str(blocker)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder whatever its mode")
def test_an_export_folder_that_cannot_be_written_is_refused(tiny_args, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert "--export-hf" in _one_line(_train(tiny_args, "--export-hf", str(locked / "model")))


def test_a_name_that_is_not_utf8_and_too_many_threads_are_one_line(tiny_args, tmp_path):
    bad = os.fsdecode(bytes(tmp_path) + b"/run-\xff")
    assert "--out-dir" in _one_line(_train(tiny_args, out=Path(bad)))
    args = [a for a in tiny_args]
    args[args.index("--threads") + 1] = "100000"
    assert "--threads: at most" in _one_line(_train(args))


def test_the_out_dir_as_swap_folder_is_named_not_called_another_run(tiny_args, tmp_path):
    """Both lock their folder: the run refused itself as "in use by another tightfit run" with its own PID."""
    out = tmp_path / "run"
    err = _one_line(_train(tiny_args, "--offload", "nvme", "--nvme", str(out), out=out))
    assert "--nvme" in err and "--out-dir too" in err and "PID" not in err
