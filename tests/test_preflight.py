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


def test_a_name_that_is_not_utf8_is_one_line_and_too_many_threads_are_capped(tiny_args, tmp_path):
    bad = os.fsdecode(bytes(tmp_path) + b"/run-\xff")
    assert "--out-dir" in _one_line(_train(tiny_args, out=Path(bad)))
    args = [a for a in tiny_args]
    args[args.index("--threads") + 1] = "100000"  # segfaulted in OpenMP: now capped at the cores, with a notice
    proc = _train(args)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"notice: --threads 100000 is more than this machine's {os.cpu_count()} cores; using " in proc.stdout


def test_the_out_dir_as_swap_folder_is_named_not_called_another_run(tiny_args, tmp_path):
    """Both lock their folder: the run refused itself as "in use by another tightfit run" with its own PID."""
    out = tmp_path / "run"
    err = _one_line(_train(tiny_args, "--offload", "nvme", "--nvme", str(out), out=out))
    assert "--nvme" in err and "--out-dir too" in err and "PID" not in err


def test_a_model_too_large_to_build_is_refused_before_it_is_allocated(tiny_args):
    """--n-embd 1048576 is 26 trillion parameters at this depth: measured on the meta device and refused in one line, instead of
    an allocation that kills the process (issue 27)."""
    err = _one_line(_train(tiny_args, "--n-embd", "1048576", "--n-head", "16"))
    assert err.startswith("tightfit: error: --n-embd/--n-layer/--seq-len: this model has 26,388,")
    assert "to build its fp32 weights" in err and "choose a smaller model" in err


@pytest.mark.parametrize("offload", ["none", "auto"])
def test_the_build_check_counts_what_the_placement_keeps(tiny_args, tmp_path, monkeypatch, capsys, offload):
    """With --offload none the states stay where they are computed (16 bytes a parameter), otherwise only the fp32
    weights are built before the planner places them (4 bytes): 6.6 M parameters against 10 MiB available."""
    import psutil

    import tightfit.models.build as build
    from tightfit.cli import main

    class Memory:
        available = 10 << 20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("allocated before the check"))
    args = [*tiny_args, "--n-embd", "512", "--n-layer", "2", "--steps", "2", "--offload", offload]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert ("for its weights, gradients and Adam moments in fp32" if offload == "none" else
            "to build its fp32 weights") in err, err
    assert ("use --offload auto" in err) == (offload == "none")


def test_a_deep_model_is_refused_without_building_it(tiny_args, monkeypatch, capsys):
    """--n-layer 100000 --n-embd 512: refused in one line from the count (`gpt.parameter_count`), not after minutes
    spent building 100,000 blocks on the meta device (issue 45: 14 min 20 s and 4.1 GB)."""
    from tightfit.cli import main
    from tightfit.train import loop

    monkeypatch.setattr(loop, "build_meta_model", lambda *a, **k: pytest.fail("built the model to count it"))
    assert main(["train", *tiny_args, "--n-layer", "100000", "--n-embd", "512", "--n-head", "8"]) == 2
    assert "this model has 315,2" in capsys.readouterr().err


@pytest.mark.parametrize("bias", [True, False])
def test_the_reference_gpts_count_is_its_parameters(bias):
    import torch

    from tightfit.models.gpt import GPT, GPTConfig, parameter_count

    cfg = GPTConfig(vocab_size=300, block_size=48, n_layer=3, n_head=4, n_embd=96, bias=bias)
    with torch.device("meta"):
        assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_a_metrics_file_hard_linked_to_a_users_file_is_refused(tiny_args, tmp_path):
    """Symlinks were refused; a hard link had the metrics appended to the user's file (issue 45)."""
    out = tmp_path / "run"
    out.mkdir()
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    os.link(mine, out / "metrics.jsonl")
    err = _one_line(_train(tiny_args, out=out))
    assert "--out-dir (metrics.jsonl)" in err and "hard link" in err
    assert mine.read_text() == "mine\n"


def test_metrics_written_into_a_folder_removed_or_linked_mid_run_is_one_line(tmp_path):
    """What preflight cannot see: the --out-dir removed while the run trains (a FileNotFoundError traceback, issue 45)
    or metrics.jsonl turned into a hard link since."""
    import shutil

    from tightfit.errors import UsageError
    from tightfit.train.progress import Progress

    out = tmp_path / "run"
    out.mkdir()
    progress = Progress(10, 0, 100, out / "metrics.jsonl", lambda: {}, enabled=True)
    progress.log({"kind": "train", "step": 1})
    mine = tmp_path / "notes.txt"
    os.link(out / "metrics.jsonl", mine)
    before = mine.read_text()
    with pytest.raises(UsageError, match="hard link"):
        progress.log({"kind": "train", "step": 2})
    assert mine.read_text() == before
    shutil.rmtree(out)
    with pytest.raises(UsageError, match="--out-dir: .* is gone"):
        progress.log({"kind": "train", "step": 3})


@pytest.mark.parametrize("planted", ["symlink", "folder"])
def test_a_step_folder_tightfit_did_not_write_is_refused_and_left(tiny_args, tmp_path, planted):
    """checkpoints/step-00000003 as a symlink to the user's archive (retention pruned through it) or a user's folder
    without an index (the save of step 3 replaced it): refused before a run that may save step 3, nothing touched
    (issue 45); beyond the run's steps it is left alone (test_checkpoint_format.py)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "my-notes.txt").write_text("mine")
    step = out / "checkpoints" / "step-00000003"
    if planted == "symlink":
        step.symlink_to(archive, target_is_directory=True)
    else:
        step.mkdir()
        (step / "my-notes.txt").write_text("mine")
    err = _one_line(_train(tiny_args, "--save-interval", "1", out=out))
    assert "step-00000003 is named like a checkpoint" in err and "--out-dir" in err
    assert (archive / "my-notes.txt").read_text() == "mine" and sorted(p.name for p in archive.iterdir()) == [
        "my-notes.txt"]
    assert (step / "my-notes.txt").read_text() == "mine"


def test_a_symlink_named_like_a_later_step_is_never_removed(tiny_args, tmp_path):
    """--resume-step drops the checkpoints after the one resumed; a symlink named like one of them (the user's
    archive) was removed through the link (issue 45). Now it is not a checkpoint at all."""
    out = tmp_path / "run"
    from tightfit.cli import main

    assert main(["train", *tiny_args, "--steps", "3", "--save-interval", "1", "--keep-checkpoints", "5"]) == 0
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "index.json").write_text("{}")  # even one that looks like a checkpoint inside
    (out / "checkpoints" / "step-00000050").symlink_to(archive, target_is_directory=True)
    assert main(["train", *tiny_args, "--steps", "3", "--resume", "--resume-step", "1", "--keep-checkpoints",
                 "5"]) == 0
    assert (out / "checkpoints" / "step-00000050").is_symlink() and (archive / "index.json").read_text() == "{}"
    assert not (archive / cw_owned()).exists()


def cw_owned() -> str:
    from tightfit.train.checkpoint_writer import OWNED

    return OWNED


def test_a_checkpoint_whose_marker_is_a_symlink_loop_is_left_alone(tiny_args, tmp_path):
    """An old checkpoint whose `.tightfit-owned` is a symlink loop: OSError traceback at pruning (issue 45). A marker
    that is a symlink was never written by a save: the folder is not a checkpoint, never pruned nor followed."""
    from tightfit.cli import main

    out = tmp_path / "run"
    assert main(["train", *tiny_args, "--steps", "2", "--save-interval", "1", "--keep-checkpoints", "5"]) == 0
    old = out / "checkpoints" / "step-00000001"
    (old / cw_owned()).unlink(missing_ok=True)
    (old / cw_owned()).symlink_to(old / cw_owned())  # a loop
    assert main(["train", *tiny_args, "--steps", "4", "--resume", "--save-interval", "1", "--keep-checkpoints",
                 "1"]) == 0  # an exception here would be the traceback
    assert (old / cw_owned()).is_symlink() and (old / "index.json").is_file()
