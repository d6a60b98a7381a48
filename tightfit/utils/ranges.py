"""Named ranges of the engine's work (copies, disk reads and writes) for a profiler's trace (`--profile DIR`).

Why a switch and not always-on `torch.profiler.record_function`: an engine copy runs thousands of times per step on
a model of small units; when nobody profiles, a range must cost nothing. Call sites write

    with ranges.span("tightfit::nvme read", name):

which is one module-attribute read and a shared no-op context while `ACTIVE` is False; the name is joined only when
a profile is being recorded. `tightfit.train.profiling` turns it on for the steps it records and off after.

The ranges run on the engine's worker threads (copy threads, disk I/O threads); the profiler records them there
only when it profiles all threads (torch's `profile_all_threads`, which `profiling.py` asks for).
"""

from __future__ import annotations

import contextlib

ACTIVE = False
"""True while a profile is recorded (set by `enable`); read on every engine transfer."""

_NULL = contextlib.nullcontext()


def enable(on: bool) -> None:
    global ACTIVE
    ACTIVE = on


def span(kind: str, detail: str = ""):
    """A `record_function` range named "kind detail" while profiling; a shared no-op context otherwise."""
    if not ACTIVE:
        return _NULL
    from torch.profiler import record_function

    return record_function(f"{kind} {detail}" if detail else kind)
