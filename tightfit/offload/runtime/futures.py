"""Small helpers for the futures every transfer and job hands out."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def done_future(value=None) -> Future:
    """A future that is already complete (what a synchronous copy returns)."""
    f: Future = Future()
    f.set_result(value)
    return f


def all_done(futures: list[Future | None]) -> Future | None:
    """A future that completes when every one of `futures` has (None entries ignored); None when none is left."""
    pending = [f for f in futures if f is not None and not f.done()]
    if not pending:
        return None
    if len(pending) == 1:
        return pending[0]
    out: Future = Future()
    remaining = [len(pending)]
    lock = threading.Lock()

    def one_done(_f) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            out.set_result(None)

    for f in pending:
        f.add_done_callback(one_done)
    return out
