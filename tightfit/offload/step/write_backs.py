"""The optimizer's write-backs in flight: tracked, never awaited on the hot path, their failures surfaced.

Why a tracker: a unit's step ends by writing its master, moments and compute params back to their tiers, and
nothing in the step needs to wait for those writes: the stores order every later load of an entry after its save
([Note: entry order] in tiers.py). What must not happen is a failed write passing unnoticed (the entry on its tier
would be stale), or a checkpoint, `close` or a benchmark reading the tier before the writes are done. So the
writes are collected here from whichever thread issued them; `check` raises a failure at the next step and `wait`
drains them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures


class WriteBacks:
    """Write-back Futures in flight, and the errors of those that failed (not yet raised)."""

    def __init__(self) -> None:
        self._pending: set[Future] = set()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def add(self, writes: list[Future]) -> None:
        """Track write-backs in flight (any thread). A finished one is forgotten at once: a done Future keeps its
        callbacks, and those reference the buffer they returned to the pool."""
        with self._lock:
            self._pending.update(writes)
        for w in writes:
            w.add_done_callback(self._done)

    def _done(self, w: Future) -> None:
        with self._lock:
            self._pending.discard(w)
            if w.exception() is not None:
                self._errors.append(w.exception())

    def check(self) -> None:
        """Raise the error of a failed write-back (its entry on the tier is stale), once."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def wait(self) -> None:
        """Block until every write-back has reached its tier; raise the first failure."""
        with self._lock:
            pending = list(self._pending)
        wait_futures(pending)
        self.check()
