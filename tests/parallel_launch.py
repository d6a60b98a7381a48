"""Helpers for the multi-process tests: a free port and a torchrun launch of tests/parallel_worker.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port nothing listens on now (bind to port 0), so parallel test runs do not clash."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def start_ranks(cmd: list[str], log_dir: Path, world: int = 2) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start `cmd` once per rank without torchrun (RANK/WORLD_SIZE/MASTER_* set by hand, one free port), each
    writing stdout and stderr to `log_dir/rank<N>.log`; returns the processes and their logs."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = log_dir / f"rank{rank}.log"
        env = rank_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs


def torchrun_worker(nproc: int, cases: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run the equivalence worker on `nproc` CPU ranks; returns the finished process (output in stdout)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=1",
           str(ROOT / "tests" / "parallel_worker.py"), *cases]
    return subprocess.run(cmd, env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def check_cases(proc: subprocess.CompletedProcess, cases: list[str]) -> list[str]:
    """Every case printed OK by rank 0; returns the OK lines (for -s output)."""
    out = proc.stdout + proc.stderr
    fails = [line for line in out.splitlines() if " FAIL " in line]
    assert not fails, "\n".join(fails[:8])
    ok = [line for line in out.splitlines() if line.startswith("[rank 0] CASE") and " OK " in line]
    missing = [c for c in cases if not any(f"CASE {c} OK" in line for line in ok)]
    assert not missing and proc.returncode == 0, f"missing {missing}, rc {proc.returncode}:\n{out[-3000:]}"
    return ok
