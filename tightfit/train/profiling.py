"""`--profile DIR`: a measured Chrome trace of real training steps, next to the plan's simulated one.

Why: `--trace` draws what the plan predicts (planner/trace.py schedules the plan's costs); a user asking why a
real step is slower than predicted needs what actually ran — the operators, and the engine's copies and disk
transfers on their own threads. This records `PROFILE_STEPS` steps with `torch.profiler` after one warm-up step
(the first step allocates buffers and fills caches), with the engine's work as named ranges (utils/ranges.py:
`tightfit::fetch`, `tightfit::copy_in`, `tightfit::pack_grads`, `tightfit::wait`, `tightfit::nvme read|write`,
`tightfit::adamw <unit>`, `tightfit::upload` on CUDA), and writes:

- `DIR/profile_trace.json`: the measured trace (open in Perfetto or chrome://tracing); each step is a
  `ProfilerStep#N` range;
- `DIR/plan_trace.json` and `DIR/memory_timeline.json` (+ `.png`, `plan.png` with matplotlib): the simulated step of
  the plan the run uses, when it has one (an offloaded run), so prediction and measurement open side by side.

Cost: nothing when `--profile` is not given (no profiler object exists, the engine's ranges are a flag test). While
recording, the profiler's own overhead makes those steps slower; the run's tokens/s includes them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tightfit.utils import ranges

PROFILE_STEPS = 3
"""Steps recorded after the warm-up step: enough to see the steady state, short enough to open in a browser."""

TRACE_NAME = "profile_trace.json"


def _all_threads_config():
    """Ask the profiler to record every thread (the engine's copy and I/O threads), where this torch can."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the main thread's ranges only
        return None


class StepProfiler:
    """Records steps 2 .. 1 + PROFILE_STEPS of the run (counted from where it starts) and writes the trace.

    The loop calls `step()` after each optimizer step and `close()` at the end (also on error)."""

    def __init__(self, folder: str | Path, plan=None, cuda: bool = False, steps: int = PROFILE_STEPS) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / TRACE_NAME
        self.written: list[Path] = []
        if plan is not None:  # the simulated step first: it is cheap and independent of the run
            from tightfit.planner.trace import write_trace

            self.written += write_trace(plan, self.folder)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        kw = {}
        config = _all_threads_config()
        if config is not None:
            kw["experimental_config"] = config
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                             on_trace_ready=self._save, **kw)
        self._open = True
        ranges.enable(True)
        self._prof.start()

    def _save(self, prof) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)  # atomic: a reader never sees half a trace
        self.written.append(self.path)
        ranges.enable(False)  # recording is over: the engine's ranges cost nothing again

    def step(self) -> None:
        if self._open:
            self._prof.step()
            if self.path in self.written:
                self.close()

    def close(self) -> list[Path]:
        """Stop recording (writing what was recorded, if nothing was yet); the files written."""
        if self._open:
            self._open = False
            try:
                self._prof.stop()
            finally:
                ranges.enable(False)
        return self.written
