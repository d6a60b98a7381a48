"""A stop signal ends a run at the end of the step in flight, with a checkpoint (tightfit/train/signals.py; issue 27).

SIGTERM (job schedulers) and SIGHUP (a closed terminal) used to kill the process as `kill -9` does: no message, no
final save. SIGINT stopped at once and threw away a checkpoint being written. Each runs `tightfit train` in a
subprocess, sends the signal once training is under way, and resumes from what it saved."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _start(tiny_args: list[str], steps: int) -> subprocess.Popen:
    args = [a for a in tiny_args]
    args[args.index("--log-interval") + 1] = "1"
    return subprocess.Popen([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", str(steps)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_steps(proc: subprocess.Popen, n: int) -> list[str]:
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"step\s+(\d+)/", line)
        if m and int(m.group(1)) >= n:
            return lines
    raise AssertionError("training did not get under way: " + "".join(lines[-20:]))


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGHUP", marks=pytest.mark.slow), "SIGINT"])
def test_a_stop_signal_saves_a_checkpoint_that_resumes(tiny_args, tmp_path, sig):
    """SIGHUP runs the handler SIGTERM's does (train/signals.py's SIGNALS): `make test-slow` runs it."""
    proc = _start(tiny_args, steps=20_000)
    _wait_for_steps(proc, 3)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    signum = getattr(signal, sig)
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    assert f"tightfit: {sig} received: finishing this step, then saving a checkpoint" in err
    assert "Traceback" not in err
    stopped = next(line for line in out.splitlines() if "received; stopped at step" in line)
    step = int(stopped.split("stopped at step ")[1].split(";")[0])
    assert f"{sig} received; stopped at step {step}; continue with --resume" in out
    ckpt = Path(tiny_args[tiny_args.index("--out-dir") + 1]) / "checkpoints" / f"step-{step:08d}"
    assert (ckpt / "index.json").is_file(), list(ckpt.parent.iterdir())
    resumed = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--steps", str(step + 2),
                              "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {step}" in resumed.stdout and "done: 2 steps" in resumed.stdout


def _trials(tiny_args, tmp_path, trials: int) -> None:
    """SIGTERM at a random step of a run that saves every step, so it lands during a checkpoint write as often as
    not: exit 143, one line on stderr, a loadable checkpoint, and --resume ends bit-identical to a run never
    stopped (issue 27)."""
    import random

    from tightfit.train.checkpoint import read_all

    total = 30
    straight = [a if a != str(tmp_path / "run") else str(tmp_path / "straight") for a in tiny_args]
    done = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *straight, "--steps", str(total)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = read_all(tmp_path / "straight")
    rng = random.Random(27)
    for trial in range(trials):
        out_dir = tmp_path / f"trial{trial}"
        args = [a if a != str(tmp_path / "run") else str(out_dir) for a in tiny_args] + ["--save-interval", "1"]
        proc = _start(args, steps=total)
        _wait_for_steps(proc, rng.randint(1, total - 10))
        time.sleep(rng.random() * 0.05)  # anywhere in the step or the save that follows it
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (trial, proc.returncode, err[-2000:])
        assert err.strip().splitlines() == ["tightfit: SIGTERM received: finishing this step, then saving a "
                                            "checkpoint"], err
        resumed = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", str(total),
                                  "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, (trial, resumed.stderr[-2000:])
        got = read_all(out_dir)
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), f"trial {trial}: not bit-identical"


def test_sigterm_during_checkpoint_writes_resumes_bit_identically(tiny_args, tmp_path):
    _trials(tiny_args, tmp_path, trials=1)  # ten in make test-slow, below


@pytest.mark.slow
def test_sigterm_during_checkpoint_writes_ten_trials(tiny_args, tmp_path):
    _trials(tiny_args, tmp_path, trials=10)


def test_no_save_on_signal_stops_without_a_checkpoint(tiny_args, tmp_path):
    """--no-save-on-signal: the signal still ends the run at the end of its step with 143, but writes no final
    checkpoint; the one saved before stays the one --resume continues from."""
    proc = _start([*tiny_args, "--save-interval", "2", "--no-save-on-signal"], steps=20_000)
    lines = _wait_for_steps(proc, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "then stopping without a checkpoint (--no-save-on-signal)" in err
    stopped = int(re.search(r"stopped at step (\d+) without a checkpoint of it", out).group(1))
    root = Path(tiny_args[tiny_args.index("--out-dir") + 1]) / "checkpoints"
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*"))
    assert steps and steps[-1] == stopped - stopped % 2 and steps[-1] >= 2, (steps, stopped, "".join(lines))


@pytest.mark.parametrize("sig,target", [("SIGTERM", "launcher"), pytest.param("SIGINT", "launcher",
                                                                                 marks=pytest.mark.slow),
                                        pytest.param("SIGTERM", "agent", marks=pytest.mark.slow)])
def test_a_stop_signal_stops_every_rank_of_a_distributed_run_at_one_step(tiny_args, tmp_path, sig, target):
    """`tightfit train --nproc-per-node 2`: the signal reaches the launcher, which hands it to every rank; the ranks
    vote after each step, stop at the same one with a checkpoint, and the launcher exits 128 + the signal's number
    with one line on stderr (issue 27). Before, the ranks died with torchrun's traceback and no checkpoint. Sent to
    torchrun's agent (the launcher's child) instead, it reaches the ranks the same way; the agent printed torch's
    SignalException traceback (issue 45)."""
    import psutil

    from parallel_launch import free_port, rank_env

    args = list(tiny_args)
    args[args.index("--log-interval") + 1] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", "20000",
                             "--nproc-per-node", "2", "--master-port", str(free_port()), "--strategy", "ddp"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**rank_env(), "PYTHONUNBUFFERED": "1"})
    _wait_for_steps(proc, 3)
    if target == "agent":
        agents = [c for c in psutil.Process(proc.pid).children() if "tightfit.parallel.launcher" in c.cmdline()]
        assert len(agents) == 1, psutil.Process(proc.pid).children()
        agents[0].send_signal(getattr(signal, sig))
    else:
        proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, err[-3000:])
    assert err.strip().splitlines() == [f"tightfit: {sig} received: finishing this step, then saving a checkpoint"
                                        + (" (Ctrl-C again to stop at once)" if sig == "SIGINT" else "")], err
    step = int(re.search(rf"{sig} received; stopped at step (\d+); continue with --resume", out).group(1))
    ckpt = Path(tiny_args[tiny_args.index("--out-dir") + 1]) / "checkpoints" / f"step-{step:08d}"
    assert (ckpt / "index.json").is_file()
    resumed = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--steps", str(step + 2),
                              "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {step}" in resumed.stdout and "done: 2 steps" in resumed.stdout
