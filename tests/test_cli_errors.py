"""Bad input: one line naming the flag or file, exit status 2, no traceback, existing checkpoints untouched."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from tightfit.cli import main


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_real_process_exit_status_and_single_line():
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", "--gpu-mem", "8XB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "--gpu-mem" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,needle", [
    (["--data", "/nonexistent/corpus"], "--data"),
    (["--steps", "-3"], "--steps"),
    (["--gpu-mem", "8XB"], "--gpu-mem"),
    (["--micro-batch", "0"], "--micro-batch"),
])
def test_bad_flags(tiny_args, capsys, extra, needle):
    assert main(["train", *tiny_args, *extra]) == 2
    assert needle in _error_line(capsys)


def test_empty_data_folder(tiny_args, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *tiny_args, "--data", str(empty)]) == 2
    assert "--data" in _error_line(capsys)


@pytest.fixture
def trained_run(tiny_args, tmp_path):
    assert main(["train", *tiny_args, "--steps", "3"]) == 0
    return tmp_path / "run" / "checkpoints" / "step-00000003" / "root.safetensors"  # one shard of the checkpoint


def test_checkpoint_from_a_different_model(tiny_args, trained_run, capsys):
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume", "--n-embd", "48"]) == 2
    err = _error_line(capsys)
    assert "different model" in err and "--resume" in err
    assert _digest(trained_run) == before


def test_truncated_checkpoint(tiny_args, trained_run, capsys):
    trained_run.write_bytes(trained_run.read_bytes()[:-64])
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume"]) == 2
    assert "root.safetensors" in _error_line(capsys)
    assert _digest(trained_run) == before


def test_corrupt_checkpoint(tiny_args, trained_run, capsys):
    trained_run.write_bytes(b"garbage" * 100)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume"]) == 2
    assert "root.safetensors" in _error_line(capsys)


def test_fresh_run_refuses_to_overwrite_a_checkpoint(tiny_args, trained_run, capsys):
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6"]) == 2
    assert "--resume" in _error_line(capsys)
    assert _digest(trained_run) == before


def test_resume_without_a_checkpoint(tiny_args, capsys):
    assert main(["train", *tiny_args, "--steps", "3", "--resume"]) == 2
    err = _error_line(capsys)
    assert "--resume" in err and "does not exist" in err
