"""The engine's host threads besides the mover's: the gradient worker and the step thread, and the timers they share.

Why a class of its own: these threads are where backward and the host overlap, and on a GPU backward runs many units
ahead of them. On a CPU it rarely does (the same cores compute backward), so the strict test mode
(TIGHTFIT_STRICT_MOVER=1, movers.py) starts every job after a random pause, as the strict mover starts every copy
late: backward then outruns the workers as it does on a GPU, and an order that only a GPU's timing would show fails
in the CPU suite ([Note: jobs and grants], host_memory.py).

A worker is one thread: its jobs run in the order they were submitted (a unit's micro-batches, the units' steps).
A job never waits for pool memory after it was submitted with its grant, except the step thread's own reservation at
the start of a step, its only one ([Note: jobs and grants]).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def set_own_threads(threads: int) -> None:
    """Run the calling thread's CPU kernels on `threads` intra-op threads, and keep it so.

    [Note: a thread's own count] Torch's OpenMP thread count is per calling thread, but a thread takes it up lazily:
    its first kernel (or `get_num_threads`) sets it to the count some thread last set, process-wide. So a count set in
    a fresh thread before that first call is overwritten by whatever another thread set meanwhile: the engine's
    workers and copy threads ran on each other's counts (on a GPU machine the gradient worker on the step thread's
    share; on a CPU-only one, once a copy thread had set its one core, the workers on one core instead of the
    process's). Asking for the count first takes the lazy set-up out of the way; the set after it stays."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class Worker:
    """One host thread running jobs in submission order. `max_delay_s` > 0 (strict mode): each job starts after a
    random pause of up to that long. `threads`: the intra-op threads of the CPU kernels its jobs run (torch's OpenMP
    count is per calling thread; None: the creating thread's, as it is now: [Note: a thread's own count]). Shut down
    by `shutdown` (the engine's close)."""

    def __init__(self, name: str, max_delay_s: float = 0.0, seed: int = 0, threads: int | None = None) -> None:
        threads = threads or torch.get_num_threads()
        self.threads = threads
        self._now = threads  # the count the thread runs its kernels with now (`use_threads`)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lambda: set_own_threads(threads))
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._last: Future | None = None  # the job submitted last: done means every job is (one thread, FIFO)

    def submit(self, fn, *args) -> Future:
        with self._lock:
            delay = self._rng.uniform(0, self.max_delay_s) if self.max_delay_s else 0.0
        if delay:
            def late():
                time.sleep(delay)
                return fn(*args)

            fut = self._pool.submit(late)
        else:
            fut = self._pool.submit(fn, *args)
        self._last = fut
        return fut

    def idle(self) -> bool:
        """Has every job submitted so far finished?"""
        last = self._last
        return last is None or last.done()

    def use_threads(self, threads: int | None) -> None:
        """From inside one of this worker's jobs: run this and later jobs' kernels on `threads` (None: unchanged)."""
        if threads and threads != self._now:
            set_own_threads(threads)
            self._now = threads

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class StepThread:
    """The step thread: one host thread running units' optimizer steps one at a time, the most urgent first.

    Why not a FIFO worker: a unit's step is queued when its gradients are complete (during backward, in backward
    order), or when the optimizer steps (after backward, with clipping), but it is needed by the unit's next forward,
    which comes in forward order: the root and the first blocks first, which backward completes last. `prioritise`
    puts the steps not started yet in that order ([Note: steps under the next forward] in step/step_queue.py); until
    then they run in the order they came. Each job is one unit's step, which reserves its buffers itself, holding no
    other grant ([Note: jobs and grants] in host_memory.py). `max_delay_s` > 0 (strict mode): each job starts after a
    random pause of up to that long. `threads`: as `Worker`'s. Stopped by `shutdown` (the engine's close)."""

    def __init__(self, name: str, max_delay_s: float = 0.0, seed: int = 0, threads: int | None = None) -> None:
        threads = threads or torch.get_num_threads()
        self.threads = threads
        self._now = threads
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        self._cv = threading.Condition()
        self._queue: list[list] = []  # [key, seq, unit, fn, future], the smallest key first
        self._seq = 0
        self._running = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, args=(threads,), name=name, daemon=True)
        self._thread.start()

    def submit(self, unit: str, fn) -> Future:
        """Queue `fn()` (one unit's step), after the steps queued before it unless `prioritise` says otherwise."""
        fut: Future = Future()
        with self._cv:
            self._seq += 1
            self._queue.append([(1, self._seq), self._seq, unit, fn, fut])
            self._cv.notify()
        return fut

    def prioritise(self, order: list[str]) -> None:
        """Run the queued steps of the units in `order` first, in that order; the others after, as they came."""
        rank = {name: i for i, name in enumerate(order)}
        with self._cv:
            for job in self._queue:
                job[0] = (0, rank[job[2]]) if job[2] in rank else (1, job[1])

    def idle(self) -> bool:
        """Has every step submitted so far finished?"""
        with self._cv:
            return not self._queue and not self._running

    def take(self, future: Future):
        """The queued step whose Future `submit` returned as `future`, taken off the queue for the caller to run:
        its fn, or None when it has started. Whoever takes it runs `fn(True)` and settles `future`."""
        with self._cv:
            for job in self._queue:
                if job[4] is future:
                    self._queue.remove(job)
                    return job[3]
        return None

    def upcoming(self, n: int) -> list[str]:
        """The units of the next `n` queued steps, in the order they will run."""
        with self._cv:
            return [job[2] for job in sorted(self._queue, key=lambda j: j[0])[:n]]

    def use_threads(self, threads: int | None) -> None:
        """From inside a job: run this and later jobs' kernels on `threads` (None: unchanged)."""
        if threads and threads != self._now:
            set_own_threads(threads)
            self._now = threads

    def _loop(self, threads: int) -> None:
        set_own_threads(threads)
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                job = min(self._queue, key=lambda j: j[0])
                self._queue.remove(job)
                self._running += 1
                delay = self._rng.uniform(0, self.max_delay_s) if self.max_delay_s else 0.0
            _, _, _, fn, fut = job
            try:
                if delay:
                    time.sleep(delay)
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - whoever waits for the unit's step raises it
                        fut.set_exception(e)
            finally:
                with self._cv:
                    self._running -= 1

    def shutdown(self) -> None:
        """Finish the queued steps, then stop."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()


def thread_budget(total: int, cuda: bool) -> dict[str, int | None]:
    """Intra-op threads per worker. [Note: thread budget] On a GPU the thread running forward and backward mostly
    launches kernels, and the host's cores are the optimizer's and the gradient worker's, which run at once during
    a backward whose units are stepped as their gradients land: if each took every core (torch's default) they would
    oversubscribe the machine and starve the launch thread and the copies' threads. So then the gradient worker
    (memory-bound adds) gets a quarter of the cores, the step thread (AdamW) the rest but one, and one stays for the
    launch thread, the completion thread and the disk's threads, which mostly wait. A worker that runs alone takes
    every core but one ("alone"): the gradient worker in a backward no step runs beside (a step that clips waits for
    backward), and the step thread once backward is over and every gradient added (on a GPU the optimizer runs long
    after the backward's kernels, and most of its work is then).

    [Note: one OpenMP pool] On a CPU device the compute itself needs the cores, and each worker runs one intra-op
    thread. Every thread that runs a parallel region gets an OpenMP pool of its own, and once the pools hold more
    threads than the machine has cores, libgomp stops spinning at every barrier, for every pool: the thread running
    forward and backward then pays a sleep and a wake-up at each of its kernels' regions, for as long as the other
    pools exist. The step thread on two threads beside it made the default run 12-20% slower on the 2-core VM (its
    steps now run under the next forward; benchmarks/RESULTS.md, batch AG); on one thread it has no pool, and its
    memory-bound work (AdamW, a sum, a norm) keeps most of a core's bandwidth."""
    if not cuda:
        return {"grads": 1, "step": 1, "alone": 1}
    grads = max(1, total // 4)
    return {"grads": grads, "step": max(1, total - grads - 1), "alone": max(1, total - 1)}


class Timers:
    """Amounts (seconds, bytes, counts) accumulated per key, from any thread: since the last `clear` (`snapshot`,
    the engine's `timings()`, which benchmarks reset around what they measure) and since the engine was built
    (`totals`, never cleared: the engine's `counters()`, which a training loop reads before and after each step)."""

    def __init__(self) -> None:
        self._t: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, key: str, amount: float) -> None:
        with self._lock:
            self._t[key] = self._t.get(key, 0.0) + amount
            self._total[key] = self._total.get(key, 0.0) + amount

    def since(self, key: str, t0: float | None) -> None:
        if t0 is not None:
            self.add(key, time.perf_counter() - t0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._t)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)

    def clear(self) -> None:
        with self._lock:
            self._t.clear()
