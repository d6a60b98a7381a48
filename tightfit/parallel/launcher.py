"""`tightfit train --nproc-per-node N`: the launcher, torchrun's agent under it, and how a failed rank is reported.

Why a launcher of our own around torchrun's agent: the run must end as one program does. A rank refused on bad
input says so in one line and the run exits 2; a Ctrl-C stops every rank at a step with a checkpoint; a rank the
kernel killed is named. Plain torchrun prints each rank's line, then a traceback of its own and a 25-line
`ChildFailedError` report, and exits 1 whatever the ranks said.

How:
- `launch` (the process the user started) holds the --out-dir lock, runs the agent in a session of its own and
  hands it signals ([Note: signals under torchrun]), and gives each rank a status folder (`STATUS_ENV`).
- Each rank that fails leaves its exit status there, and for bad input its one line instead of printing it
  (`report_failure`). The launcher prints one line, rank 0's (or the lowest rank's that has one), once every rank
  has ended, and exits with that rank's status.
- The agent (`python -m tightfit.parallel.launcher`, torchrun's own `run()`) leaves out its report of a failed
  rank. A rank that failed without leaving a status (killed by a signal: the out-of-memory killer's SIGKILL; a
  crash in native code) gets one line from the agent: which rank, and how it ended. A rank that lost contact
  with a dead peer says so at once, itself, and leaves only its status.
Under torchrun or a scheduler started by hand (no status folder) every rank prints its own line, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MONITOR_INTERVAL_S = 1
"""How often torchrun's agent checks its workers: the bound on how long survivors of a dead rank keep running."""

STATUS_ENV = "TIGHTFIT_RANK_STATUS"
"""Set by `launch` for its workers: a folder where each failed rank leaves its exit status (and its line)."""

LOCK_HELD_ENV = "TIGHTFIT_OUT_DIR_LOCKED"
"""Set by `launch` for its workers: the --out-dir whose lock the launcher holds."""


def launch(cfg, argv: list[str]) -> int:
    """Re-run `tightfit <argv>` under torchrun's agent with cfg's node/process layout; the run's exit status."""
    p = cfg.parallel
    cmd = [sys.executable, "-m", "tightfit.parallel.launcher", f"--nproc-per-node={p.nproc_per_node}",
           f"--nnodes={p.nnodes}", f"--node-rank={p.node_rank}", f"--master-addr={p.master_addr}",
           f"--master-port={p.master_port}", "--max-restarts=0", f"--monitor-interval={MONITOR_INTERVAL_S}",
           "-m", "tightfit.cli", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; stated so CPU ranks do not oversubscribe
    from tightfit.train.data import corpus_files
    from tightfit.utils.run_lock import RunLock

    corpus_files(cfg.data.data)  # a missing --data is one line here, before any worker starts

    # The launcher is the run: it holds the --out-dir lock (a second run is refused here, in one line, before any
    # worker starts) and tells its workers so, so rank 0 does not take it again.
    with RunLock.acquire(cfg.train.out_dir, "--out-dir"):
        env[LOCK_HELD_ENV] = str(Path(cfg.train.out_dir).resolve())
        # [Note: signals under torchrun] the agent runs in a session of its own, so a terminal's Ctrl-C or hang-up
        # reaches this launcher only; it hands the signal to every rank (the agent's own handler would tear the
        # workers down). The ranks vote after each step, stop together with a checkpoint and end normally; the
        # launcher then exits as a process that signal ended (128 + its number).
        status = tempfile.mkdtemp(prefix="tightfit-status-")
        env[STATUS_ENV] = status
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        received: list[int] = []

        def forward(signum, frame) -> None:
            received.append(signum)
            for child in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signum)

        old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        try:
            code, line = worker_outcome(status, proc.wait())
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            shutil.rmtree(status, ignore_errors=True)
        if line:
            print(f"tightfit: error: {line}", file=sys.stderr)
        if received and code == 0:
            return 128 + received[0]
        return code


def _descendants(pid: int) -> list[int]:
    """The PIDs of every process below `pid` (the agent's workers), deepest last."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def report_failure(code: int, line: str | None = None) -> bool:
    """Leave this rank's exit status (and its one line, for bad input) where the launcher reads them. True when
    there is such a launcher: the line is then its to print, once for the run."""
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return False
    if code:
        with contextlib.suppress(OSError):
            path = Path(folder, f"rank-{os.environ.get('RANK', '0')}")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{code}\n{line or ''}")
            os.replace(tmp, path)  # the launcher never reads half a report
    return True


def _reports(folder: str | Path) -> dict[int, tuple[int, str]]:
    """rank -> (exit status, its line or "") of every rank that reported a failure."""
    found = {}
    for f in Path(folder).glob("rank-*"):
        with contextlib.suppress(OSError, ValueError):
            code, _, line = f.read_text().partition("\n")
            found[int(f.name[5:])] = (int(code), line.strip())
    return found


def worker_outcome(folder: str | Path, code: int) -> tuple[int, str | None]:
    """(the status a distributed run exits with, the line to print or None).

    The agent's status, unless it failed because a rank did; then rank 0's (the one that decides for all), else
    the lowest failed rank's (2: bad input, 1: a bug or a lost peer). The line: rank 0's, else the lowest rank's
    that left one."""
    found = _reports(folder)
    if code == 0 or not found:
        return code, None
    line = next((found[r][1] for r in sorted(found) if found[r][1]), None)
    return found[min(found)][0], line


def _silent_failures(error) -> list[str]:
    """One line for each rank in torchrun's `ChildFailedError` that ended without leaving a report: killed by a
    signal (the out-of-memory killer's SIGKILL, a crash in native code) or an exit nothing explained. Not the
    SIGTERM the agent itself sends the other ranks when one fails."""
    folder = os.environ.get(STATUS_ENV)
    lines = []
    for rank, failure in sorted(error.failures.items()):
        if (folder and Path(folder, f"rank-{rank}").exists()) or failure.exitcode == -signal.SIGTERM:
            continue
        if failure.exitcode < 0:
            name = failure.signal_name()
            why = (" (sent by another process, or by the kernel's out-of-memory killer: `dmesg` says which)"
                   if name == "SIGKILL" else "")
            lines.append(f"rank {rank} (pid {failure.pid}) was killed by {name}{why}")
        else:
            lines.append(f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode} without saying why")
    return lines


def agent(argv: list[str]) -> int:
    """torchrun's agent, run with `argv` (torchrun's arguments), without its report of a failed rank."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Its "failed (exitcode: ...)" line and the notices of closing the other ranks: the launcher's line says it.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Its "Received 15 death signal, shutting down workers": each rank says what it does with the signal.
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        for line in _silent_failures(e):
            print(f"tightfit: error: {line}", file=sys.stderr)
        return 1
    except SignalException as e:  # a signal sent to the agent itself: it passed it on to the ranks, which stop at
        return 128 + int(e.sigval)  # the end of their step with a checkpoint (train/signals.py) and say so
    return 0


if __name__ == "__main__":
    sys.exit(agent(sys.argv[1:]))
