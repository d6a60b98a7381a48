"""The NVMe tier's I/O threads: a fixed set of workers serving transfers by priority class.

Why not a ThreadPoolExecutor: its queue is first-in first-out, and a disk shared by a training step has requests
of very different urgency. A read of the parameters the next unit computes with is on the critical path; reading
the optimizer moments a step will use a few units later is not; a write-back only has to finish before its entry
is next read (the store orders that, tiers.py). In FIFO order a 300 MB write-back of the embedding issued at the
end of one step sits in front of the first parameter read of the next forward, and the forward waits for it.
Here every transfer carries a class, workers always take the oldest transfer of the most urgent class waiting,
and within a class order is kept. Nothing is pre-empted: a transfer once started runs to completion, and transfers
are cut into chunks of a few MB (nvme/transfer.py), so an urgent read waits at most for the chunks already running.

Starvation: lower classes run whenever no more urgent transfer waits. In training, urgent reads are bounded by
the prefetch depth, so write-backs always drain between them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

FETCH = 0
"""Parameters a unit is about to compute with (a prefetch, or the unit waiting for them right now)."""
LOAD = 1
"""Other reads: optimizer state for a step, gradients being accumulated, exports."""
WRITE = 2
"""Write-backs."""
CLASSES = (FETCH, LOAD, WRITE)


class IoQueue:
    """`threads` worker threads running submitted calls, most urgent class first, FIFO within a class."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._cond = threading.Condition()
        self._queues: list[deque] = [deque() for _ in CLASSES]
        self._closed = False
        # Daemon threads: an engine that is never closed must not keep the interpreter alive at exit.
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable, args: tuple, done: Callable[[BaseException | None], None]) -> None:
        """Run `fn(*args)` on a worker, then `done(None)`, or `done(exc)` if it raised.

        A callback rather than a Future per call: the NVMe store submits one call per chunk, thousands per step,
        and a Future (with its condition variable and lock) per chunk is enough garbage-collected objects to make
        the collector's full passes a visible share of a training step."""
        self.submit_all(priority, [(fn, args, done)])

    def submit_all(self, priority: int, calls: list[tuple[Callable, tuple, Callable]]) -> None:
        """`submit` for several (fn, args, done) at once: one lock and one wake-up call for a request's chunks."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the I/O queue is shut down")
            self._queues[priority].extend(calls)
            self._cond.notify(len(calls))

    def waiting(self) -> list[int]:
        """Transfers queued (not yet started) per class."""
        with self._cond:
            return [len(q) for q in self._queues]

    def shutdown(self) -> None:
        """Run what is queued, then stop the workers and join them. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not any(self._queues):
                    self._cond.wait()
                queue = next((q for q in self._queues if q), None)
                if queue is None:  # shut down and drained
                    return
                fn, args, done = queue.popleft()
            try:
                fn(*args)
            except BaseException as e:  # handed to the caller through `done`
                done(e)
            else:
                done(None)
