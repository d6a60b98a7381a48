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


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_saves_a_checkpoint_that_resumes(tiny_args, tmp_path, sig):
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
