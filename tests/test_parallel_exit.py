"""How a rank of a distributed `tightfit train` ends ([Note: leaving the process group], tightfit/parallel/mesh.py).

A rank once aborted at interpreter exit ("terminate called without an active exception", SIGABRT) after its run
had finished and its checkpoint was committed: torch keeps gloo's threads alive past `destroy_process_group`
(DeviceMeshes in DTensor's caches hold the groups), and the interpreter's teardown then destroyed them in no
particular order. A rank now ends with `os._exit` once its group is destroyed, on success and on error alike.

Each rank here runs the real CLI under a prelude that (1) registers an atexit handler that aborts, standing in for
what torch's leftover gloo objects may do at teardown, and (2) reports, at `os._exit`, the status, whether the
process group is still initialized and which Python threads are alive. A rank that went through the
interpreter's teardown dies of SIGABRT and never reports.
"""

from __future__ import annotations

import sys

from parallel_launch import start_ranks

PRELUDE = """
import atexit, os, sys, threading
atexit.register(os.abort)  # what teardown may do with torch's leftover gloo threads
_exit = os._exit
def _report(code):
    import torch.distributed as dist
    names = sorted(t.name for t in threading.enumerate())
    sys.stdout.write(f"LEAVING status={code} initialized={dist.is_initialized()} threads={names}\\n")
    sys.stdout.flush()
    _exit(code)
os._exit = _report
from tightfit.cli import main
sys.exit(main())
"""


def _ranks(tiny_args, tmp_path, *extra: str, timeout: float = 240) -> tuple[list[int], list[str]]:
    cmd = [sys.executable, "-c", PRELUDE, "train", *tiny_args, "--steps", "2", "--eval-interval", "2",
           "--dist-timeout", "40", *extra]
    procs, logs = start_ranks(cmd, tmp_path)
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, [log.read_text(errors="replace") for log in logs]


def test_a_finished_rank_leaves_after_destroying_its_group_without_teardown(tiny_args, tmp_path):
    """zero2: FSDP2's DTensors are what keep the gloo groups alive past destroy_process_group."""
    codes, outs = _ranks(tiny_args, tmp_path, "--strategy", "zero2")
    assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    for out in outs:
        assert "LEAVING status=0 initialized=False threads=['MainThread']" in out, out[-2000:]
    assert "done: 2 steps" in outs[0]  # printed to a file (block-buffered): flushed before os._exit
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "index.json").is_file()


def test_a_refused_rank_leaves_with_one_line_and_status_2(tiny_args, tmp_path):
    """Bad input found after the group exists (every rank refuses --resume: the --out-dir holds no checkpoint): one
    line, status 2, no traceback, the group destroyed, and the same way out."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    codes, outs = _ranks(tiny_args, tmp_path, "--strategy", "ddp", "--resume")
    assert codes == [2, 2], outs[0][-2000:] + outs[1][-2000:]
    for out in outs:
        errors = [line for line in out.splitlines() if line.startswith("tightfit: error:")]
        assert len(errors) == 1 and "--resume" in errors[0] and "no checkpoint in" in errors[0], out
        assert "Traceback" not in out
        assert "LEAVING status=2 initialized=False threads=['MainThread']" in out, out[-2000:]
