"""A diverging run never replaces its last good checkpoint, says what diverged, and resumes from the good one."""

from __future__ import annotations

import math

import pytest
import torch

from tightfit.cli import main
from tightfit.config import Config, TrainConfig, config_from_args
from tightfit.errors import UsageError
from tightfit.train.checkpoint import latest, read_all
from tightfit.train.checkpoint_writer import committed
from tightfit.train.loop import train

PLACEMENTS = {"plain": ["--offload", "none"], "host": ["--offload", "host"], "nvme": ["--offload", "nvme"]}


def _args(tiny_args, out_dir, placement, tmp_path):
    i = tiny_args.index("--out-dir")
    args = tiny_args[: i + 1] + [str(out_dir)] + tiny_args[i + 2:] + PLACEMENTS[placement]
    return args + (["--nvme", str(tmp_path / "swap")] if placement == "nvme" else [])


def _config(args) -> Config:
    from tightfit.cli import _parser

    return config_from_args(_parser().parse_args(["train", *args]))


def _all_finite(out_dir) -> bool:
    return all(bool(torch.isfinite(t).all()) for k, t in read_all(out_dir).items() if t.is_floating_point())


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("placement", ["plain", "nvme"])
def test_infinite_weight_decay_keeps_the_good_checkpoint_and_resume_is_exact(tiny_args, tmp_path, placement):
    straight = _args(tiny_args, tmp_path / "straight", placement, tmp_path)
    assert main(["train", *straight, "--steps", "6"]) == 0
    run = _args(tiny_args, tmp_path / "run", placement, tmp_path)
    assert main(["train", *run, "--steps", "6", "--stop-at", "3"]) == 0
    good = read_all(tmp_path / "run")

    # The same run continued with an infinite weight decay (built in Python: the CLI may refuse the value): its
    # first step makes every decayed weight infinite, and the save after it is refused.
    cfg = _config([*run, "--steps", "6", "--resume", "--save-interval", "1"])
    cfg.optim.weight_decay = math.inf
    with pytest.raises(UsageError) as e:
        train(cfg, quiet=True)
    msg = str(e.value)
    assert "diverged at step 4" in msg and "parameter " in msg and "inf" in msg, msg
    assert "last good checkpoint is step 3" in msg and not msg.startswith("--lr")
    assert "--weight-decay" in msg and "--lr" in msg  # causes listed, none singled out
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [3]
    assert all(torch.equal(good[k], v) for k, v in read_all(tmp_path / "run").items())

    # Resumed from the good checkpoint with the run's own settings: bit-identical to the uninterrupted run.
    assert main(["train", *run, "--steps", "6", "--resume"]) == 0
    ref, got = read_all(tmp_path / "straight"), read_all(tmp_path / "run")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.parametrize("placement", ["plain", "host"])
def test_huge_learning_rate_saves_nothing_non_finite(tiny_args, tmp_path, capsys, placement):
    run = _args(tiny_args, tmp_path / "run", placement, tmp_path)
    assert main(["train", *run, "--steps", "3"]) == 0
    capsys.readouterr()
    assert main(["train", *run, "--steps", "40", "--resume", "--lr", "9.99", "--min-lr", "9.99",
                 "--warmup-steps", "0", "--weight-decay", "1000", "--save-interval", "1", "--grad-clip", "0",
                 "--keep-checkpoints", "3"]) == 2
    err = _error_line(capsys)
    assert "training diverged at step" in err and "last good checkpoint is step" in err
    assert any(w in err for w in ("the loss became", "the gradient norm became", "parameter ", "Adam")), err
    steps = [s for s, _ in committed(tmp_path / "run" / "checkpoints")]
    assert steps and len(steps) <= 3 and f"step {steps[-1]} in" in err
    assert _all_finite(tmp_path / "run")
    # The last good checkpoint loads and trains (a notice says the settings changed). Its weights are finite but
    # may be far too large to continue from: then that is found at once, in one line, and nothing is replaced.
    code = main(["train", *run, "--steps", str(steps[-1] + 2), "--resume"])
    out, err = capsys.readouterr()
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step-{steps[-1]:08d} at step {steps[-1]}" in out
    assert "notice: resuming with settings changed since the checkpoint: --lr 9.99 -> 0.004" in out
    assert code == 0 or (code == 2 and "training diverged" in err and "Traceback" not in err)
    assert latest(tmp_path / "run").name == f"step-{(steps[-1] + 2) if code == 0 else steps[-1]:08d}"
    assert _all_finite(tmp_path / "run")


def test_non_finite_gradient_norm_is_named(tiny_args, tmp_path, monkeypatch):
    """A gradient norm that is inf (clipping on) stops the run before the optimizer step is saved."""
    from tightfit.train import memory

    real = memory.PlainMemory.clip_grad_norm
    calls = []

    def clip(self, max_norm):
        calls.append(1)
        return real(self, max_norm) if len(calls) < 3 else math.inf

    monkeypatch.setattr(memory.PlainMemory, "clip_grad_norm", clip)
    cfg = _config(_args(tiny_args, tmp_path / "run", "plain", tmp_path) + ["--steps", "5", "--save-interval", "1"])
    with pytest.raises(UsageError, match=r"diverged at step 3: the gradient norm became inf; the last good "
                                         r"checkpoint is step 2"):
        train(cfg, quiet=True)
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [2]


def test_keep_checkpoints_keeps_the_newest(tiny_args, tmp_path):
    run = _args(tiny_args, tmp_path / "run", "plain", tmp_path)
    assert main(["train", *run, "--steps", "5", "--save-interval", "1", "--keep-checkpoints", "2"]) == 0
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [4, 5]
    assert TrainConfig().keep_checkpoints == 1


def test_keep_checkpoints_must_not_be_negative(tiny_args, capsys):
    assert main(["train", *tiny_args, "--keep-checkpoints", "-1"]) == 2
    assert "--keep-checkpoints" in _error_line(capsys)


@pytest.mark.parametrize("placement", ["plain", "nvme"])
def test_keep_checkpoints_0_writes_none_and_needs_no_room_for_one(tiny_args, tmp_path, capsys, monkeypatch,
                                                                  placement):
    """A benchmark or a throwaway run on a disk too small for a checkpoint beside its swap files: nothing is
    written to checkpoints/, and the room a checkpoint would need is not asked for."""
    import tightfit.train.loop as loop

    monkeypatch.setattr(loop, "check_room", lambda *a: pytest.fail("checked room for a checkpoint"))
    run = _args(tiny_args, tmp_path / "run", placement, tmp_path)
    assert main(["train", *run, "--steps", "3", "--keep-checkpoints", "0"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: none (--keep-checkpoints 0)" in out and "checkpoint none" in out
    ckpt_root = tmp_path / "run" / "checkpoints"
    assert not ckpt_root.exists() or not any(ckpt_root.iterdir())
    assert (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag", [["--save-interval", "1"], ["--stop-at", "2"], ["--resume"],
                                  ["--nproc-per-node", "2"]])
def test_keep_checkpoints_0_refuses_what_needs_a_checkpoint(tiny_args, capsys, flag):
    assert main(["train", *tiny_args, "--keep-checkpoints", "0", *flag]) == 2
    err = _error_line(capsys)
    assert flag[0] in err or "--keep-checkpoints" in err
