"""The units' optimizer steps in flight: queued on the step thread, each waited for by whoever next uses its unit.

[Note: steps under the next forward] A unit's optimizer step is a job on the step thread (runtime/workers.py,
`StepThread`), not work of the thread running forward and backward (but see [Note: a step run by the thread that
waits for it] below): queued during backward as the unit's gradients land (`AdamW.step_during_backward`: no clip),
or by `opt.step()` after backward (a clip or a loss scale needs every gradient first). `opt.step()` returns at once;
until a unit's step is done the unit is `stepping`, and whoever uses its states waits for that step alone (`wait`):
its next forward (the engine's `materialise`), a read of its values (`read_master`, a parameter read, a state dict,
a checkpoint: `wait_all`), a prefetch (skipped until it is done). Once backward ends, the steps not started yet run
in the next forward's order (`prioritise`: the root, then the blocks as the last forward met them): the forward
computes unit k while the step thread steps unit k + 1, and waits only where a step is not done when the forward
reaches its unit. That wait, from the step's start, is the optimizer's time nothing hid: `optimizer_exposed_s`
(before the start, the unit's gradients were still landing: `step_grads_wait_s`). What cannot be hidden this way is
the first units' steps: the root's embedding is needed first and its gradient lands last, and a clipped step cannot
start before every gradient has. A step reads the hyperparameters its group had when it was queued
(`optim.AdamW._work`): a loop sets the next step's learning rate before it runs. The gradients are the step's from
then on: `zero_grad`, `model.zero_grad()` and a unit-major pass leave a `stepping` unit's alone, and its step clears
them.

[Note: a step run by the thread that waits for it] On a CPU device the compute takes every core, so the step thread
runs in the compute's gaps, and a forward that reaches a unit whose step has not even started would wait for the
step thread to get a core, run the step on its one intra-op thread and wake the forward. Instead the waiting thread
takes the step off the queue and runs it itself, on its own intra-op threads (`StepThread.take`; `runs_here`). Only
a step that needs no buffer of the pool (its states stepped in place on their tiers): the thread running forward and
backward then reserves nothing, so a step it runs cannot wait for a grant ([Note: jobs and grants]). Its time is
exposed as a waited step's is (on the 2-core VM the forward's waits fell from 24-43% of the optimizer's time to
about 5%, the step's wall time unchanged: benchmarks/RESULTS.md, batch AO). On a GPU (and on the CPU device standing
in for one) the waiting thread is the one launching the device's kernels, and the host's cores are the optimizer's:
steps stay on the step thread.

Why a class of its own: the engine decides *when* a unit steps (its hooks, `opt.step()`); this is how a step waits
for its gradients, runs, hands its write-backs to the tracker, and is waited for, with the timers that say how much
of it the forward saw.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from tightfit.offload.runtime.workers import StepThread, Timers
from tightfit.offload.step.unit import OffloadUnit
from tightfit.offload.step.write_backs import WriteBacks


class StepQueue:
    """Collaborators: the step thread, the write-back tracker, the timers; `before(unit)`: run on the step thread
    before each step (the engine sets its thread count and preloads the next queued units' states)."""

    def __init__(self, worker: StepThread, writes: WriteBacks, timers: Timers,
                 before: Callable[[OffloadUnit], None],
                 runs_here: Callable[[OffloadUnit], bool] = lambda unit: False) -> None:
        self.worker = worker
        self.writes = writes
        self.timers = timers
        self.before = before
        self.runs_here = runs_here  # may a thread waiting for the unit's step run it? ([Note: a step run by ...])

    def submit(self, unit: OffloadUnit, run: Callable[[], list]) -> None:
        """Queue `run()`, one unit's optimizer step (returning its write-backs), after the unit's gradients have
        landed. The step reserves its buffers there, one step at a time ([Note: jobs and grants] in
        runtime/host_memory.py); until it is done the unit is `stepping`."""
        pending = unit.grad_pending

        def after_grads(here: bool = False) -> float:
            if pending is not None:
                pending.result()
            started = time.perf_counter()
            if not here:  # the step thread's own set-up: its threads, the next steps' preloads
                self.before(unit)
            self.writes.add(run())  # the unit's write-backs, still in flight
            return started

        unit.stepping = self.worker.submit(unit.name, after_grads)

    def prioritise(self, order: list[str]) -> None:
        """The steps not started yet run in `order` (the next forward's)."""
        self.worker.prioritise(order)

    def wait(self, unit: OffloadUnit) -> None:
        """The unit's last optimizer step is done (its error raised here); the wait is timed, from the step's start,
        as `optimizer_exposed_s`."""
        f = unit.stepping
        if f is None:
            return
        if not f.done():
            t0 = time.perf_counter()
            # Not started: run here ([Note: a step run by the thread that waits for it])
            run = self.worker.take(f) if self.runs_here(unit) else None
            if run is not None and f.set_running_or_notify_cancel():
                try:
                    f.set_result(run(True))
                except BaseException as e:  # noqa: BLE001 - raised below, as a step thread's error would be
                    f.set_exception(e)
            with contextlib.suppress(BaseException):
                f.result()
            t1 = time.perf_counter()
            started = f.result() if f.exception() is None else t0
            self.timers.add("optimizer_exposed_s", t1 - max(t0, started))
            self.timers.add("step_grads_wait_s", max(0.0, min(started, t1) - t0))
        unit.stepping = None
        f.result()

    def wait_all(self, units) -> None:
        """Wait for every unit's step still running or queued (not for their write-backs). Raises the first step's
        error, after waiting for all."""
        error = None
        for unit in units:
            try:
                self.wait(unit)
            except BaseException as e:  # noqa: BLE001 - raised once every step is done
                error = error or e
        if error is not None:
            raise error
