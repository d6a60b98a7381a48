"""A diverging run never replaces its last good checkpoint, says what diverged, and resumes from the good one."""

from __future__ import annotations

import math
import re

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
    assert "newest healthy checkpoint is step 3" in msg and "--resume --resume-step 3 --lr" in msg
    assert "--weight-decay" in msg and "--grad-clip" in msg  # the other causes are listed
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [3]
    assert all(torch.equal(good[k], v) for k, v in read_all(tmp_path / "run").items())

    # Resumed from the good checkpoint with the run's own settings: bit-identical to the uninterrupted run.
    assert main(["train", *run, "--steps", "6", "--resume"]) == 0
    ref, got = read_all(tmp_path / "straight"), read_all(tmp_path / "run")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def _advice(err: str) -> tuple[bool, list[str]]:
    """(resume?, flags) the divergence message advises: continue from the newest healthy checkpoint, or start over."""
    m = re.search(r"continue from it with (--resume --resume-step \d+ .*?)\. Other", err) or re.search(
        r"start over in a new --out-dir with (.*?)\. Other", err)
    assert m, err
    return m.group(1).startswith("--resume"), m.group(1).split()


# Each run must reach a non-finite loss on every CPU: a learning rate alone leaves it to chaos whether the weights
# overflow within the run (with lr 9.99 and no decay the loss went to inf on one VM and stayed near 1e5 on another,
# whose CPU rounds differently), so the weight decay makes the blow-up certain: AdamW multiplies every weight by
# 1 - lr x wd each step, a factor of |1 - 9.99 x 2| ~ 19 once the warm-up is over, which overflows fp32 in ~30 steps.
DIVERGING = {
    # the first update wrecks the model: no checkpoint worth resuming, the advice is to start over
    "lr-at-once": ["--n-embd", "64", "--lr", "9.99", "--warmup-steps", "2", "--weight-decay", "2"],
    # healthy for a few steps during the warm-up, then a spike, then inf: resume from before the spike
    "lr-slow": ["--n-embd", "64", "--lr", "9.99", "--warmup-steps", "100", "--weight-decay", "2", "--grad-clip", "0"],
    # everything extreme at once (a resumed run): the advice must undo the weight decay and the clipping too
    "extreme": ["--lr", "9.99", "--min-lr", "9.99", "--warmup-steps", "0", "--weight-decay", "1000",
                "--grad-clip", "0", "--keep-checkpoints", "3"],
}


# Every variant on plain PyTorch, the offloaded placements with one in `make test` and all in `make test-slow`.
@pytest.mark.parametrize("variant,placement", [
    (variant, placement) if placement == "plain" or variant == "lr-slow" else
    pytest.param(variant, placement, marks=pytest.mark.slow)
    for placement in ("plain", "host", "nvme") for variant in DIVERGING])
def test_following_the_divergence_advice_trains_on(tiny_args, tmp_path, capsys, placement, variant):
    """A divergence names a checkpoint that resuming from helps and the flags that do it: followed to the letter,
    the run trains to its end (issue 27). Nothing non-finite is saved; retention kept the healthy checkpoint."""
    run = _args(tiny_args, tmp_path / "run", placement, tmp_path)
    resumed = variant == "extreme"
    if resumed:  # three healthy steps first, then the same run continued with extreme settings
        assert main(["train", *run, "--steps", "3"]) == 0
    capsys.readouterr()
    diverging = [*run, "--steps", "120", "--save-interval", "1", *DIVERGING[variant], *(["--resume"] * resumed)]
    assert main(["train", *diverging]) == 2
    err = _error_line(capsys)
    assert "training diverged at step" in err and "learning rate in force" in err, err
    assert _all_finite(tmp_path / "run")
    resume, flags = _advice(err)
    if variant == "lr-slow":
        assert resume and "the loss first spiked at step" in err, err
    if variant == "extreme":
        assert resume and "--resume-step 3" in err and "--weight-decay 0.1" in err and "--grad-clip 1" in err, err
    if resume:
        assert main(["train", *diverging, *flags]) == 0, capsys.readouterr().err
    else:
        again = [*_args(tiny_args, tmp_path / "again", placement, tmp_path), "--steps", "120", "--save-interval",
                 "1", *DIVERGING[variant], *flags]
        assert main(["train", *again]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "done: " in out and "inside a loss spike" not in out, out


def test_a_spike_keeps_the_newest_healthy_checkpoint(tiny_args, tmp_path, capsys):
    """--keep-checkpoints 1 through a loss spike: the checkpoints taken inside it are marked suspect and the one
    before it stays, so `--resume-step` can go back to it; the newer ones go once the resumed run commits."""
    from tightfit.train.health import HEALTHY, SUSPECT, verdict_of

    run = _args(tiny_args, tmp_path / "run", "plain", tmp_path) + ["--n-embd", "64"]
    # a spike within the warm-up's first 12 steps, without the decay that would end the run in a blow-up
    spiking = ["--lr", "9.99", "--warmup-steps", "100", "--weight-decay", "0", "--grad-clip", "0"]
    assert main(["train", *run, "--steps", "12", "--save-interval", "1", *spiking]) == 0
    out = capsys.readouterr().out
    assert "warning: the loss spiked at step" in out and "warning: the final checkpoint (step 12)" in out, out
    found = committed(tmp_path / "run" / "checkpoints")
    assert len(found) == 2 and found[-1][0] == 12, found
    good, newest = found
    assert verdict_of(good[1]) == HEALTHY and verdict_of(newest[1]) == SUSPECT
    assert f"the newest healthy one is step {good[0]}" in out
    end = good[0] + 3
    assert main(["train", *run, "--steps", str(end), "--resume", "--resume-step", str(good[0]), "--lr", "0.004",
                 "--save-interval", "1", "--keep-checkpoints", "2"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {good[1]} at step {good[0]}" in out
    assert f"removed the checkpoints of step 12: this run, resumed from step {good[0]}, replaces them" in out
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [end - 1, end]


def test_resume_step_names_what_is_there(tiny_args, tmp_path, capsys):
    run = _args(tiny_args, tmp_path / "run", "plain", tmp_path)
    assert main(["train", *run, "--steps", "3", "--save-interval", "1", "--keep-checkpoints", "2"]) == 0
    capsys.readouterr()
    assert main(["train", *run, "--steps", "5", "--resume", "--resume-step", "1"]) == 2
    assert _error_line(capsys) == (f"tightfit: error: --resume-step: {tmp_path / 'run'} holds no checkpoint of step "
                                   "1; it holds step 2, 3")
    assert main(["train", *run, "--steps", "5", "--resume-step", "2"]) == 2
    assert "--resume-step" in _error_line(capsys)


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
    with pytest.raises(UsageError, match=r"diverged at step 3: the gradient norm became inf \(learning rate in "
                                         r"force [^)]*\); the newest healthy checkpoint is step 1 .* --resume "
                                         r"--resume-step 1 --lr"):
        train(cfg, quiet=True)
    # Step 2's weights gave the inf norm: that checkpoint is suspect, and the healthy one before it stays.
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [1, 2]


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


@pytest.mark.parametrize("flag", [["--save-interval", "1"], ["--stop-at", "2"], ["--resume"]])
def test_keep_checkpoints_0_refuses_what_needs_a_checkpoint(tiny_args, capsys, flag):
    assert main(["train", *tiny_args, "--keep-checkpoints", "0", *flag]) == 2
    err = _error_line(capsys)
    assert flag[0] in err or "--keep-checkpoints" in err


@pytest.mark.parametrize("crafted", ["not json", "[1, 2]", '{"verdict": "healthy", "loss": "x"}', "fifo", "symlink",
                                     "deep", '{"verdict": "healthy", "reference_loss": NaN}'])
def test_a_crafted_health_record_changes_nothing(tiny_args, tmp_path, capsys, crafted):
    """health.json is untrusted like the rest of a checkpoint: a bad one is no record (no protection, no advice),
    never a traceback or a hang, and resuming trains as from any checkpoint (issue 27)."""
    import os

    from tightfit.train.health import HEALTH, read_record

    run = _args(tiny_args, tmp_path / "run", "plain", tmp_path)
    assert main(["train", *run, "--steps", "2"]) == 0
    folder = latest(tmp_path / "run")
    (folder / HEALTH).unlink()
    if crafted == "fifo":
        os.mkfifo(folder / HEALTH)
    elif crafted == "symlink":
        (folder / HEALTH).symlink_to("/dev/zero")
    elif crafted == "deep":
        (folder / HEALTH).write_text("[" * 100000 + "]" * 100000)
    else:
        (folder / HEALTH).write_text(crafted)
    assert read_record(folder) is None
    capsys.readouterr()
    assert main(["train", *run, "--steps", "3", "--resume"]) == 0, capsys.readouterr().err


def test_a_distributed_run_keeps_and_judges_checkpoints_like_one_process(tiny_args, tmp_path):
    """Under `--nproc-per-node 2` rank 0 writes the same health records and keeps the same checkpoints
    (--keep-checkpoints was ignored: always 1), and a divergence names the checkpoint and flags to continue with."""
    import subprocess
    import sys

    from parallel_launch import ROOT, free_port, rank_env
    from tightfit.train.health import HEALTHY, verdict_of

    def launch(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--nproc-per-node", "2",
                               "--master-port", str(free_port()), "--strategy", "ddp", *extra], env=rank_env(),
                              cwd=ROOT, capture_output=True, text=True, timeout=180)

    done = launch("--steps", "4", "--save-interval", "1", "--keep-checkpoints", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    kept = committed(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in kept] == [3, 4] and all(verdict_of(f) == HEALTHY for _, f in kept)
    bad = launch("--steps", "60", "--save-interval", "1", "--resume", *DIVERGING["extreme"])
    assert bad.returncode == 2, bad.stderr[-3000:]  # rank 0's status, not torchrun's 1
    ours = [line for line in bad.stderr.splitlines() if line.startswith("tightfit:")]
    assert len(ours) == 1 and "training diverged at step" in ours[0], bad.stderr[-3000:]  # rank 0's line alone
    assert "--resume --resume-step 4 --lr 0.004" in ours[0], ours
