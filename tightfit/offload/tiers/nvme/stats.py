"""The NVMe tier's bandwidth accounting: bytes moved and busy time per direction, for `NvmeStore.stats`.

Why a class of its own: the counters change at the start and end of every chunk, on the I/O threads, and answer
one question, how fast the disk moved bytes while it was busy. They need a lock of their own, never held while
waiting on I/O; the store's lock (files, pending requests) has nothing to do with them.

Busy time is wall time during which at least one chunk of that direction was executing, so concurrent chunks
are not double-counted and idle gaps between requests are not counted. `busy_s` is the same for either direction
(the disk was busy); `read_share_s` and `write_share_s` split it between the directions in proportion to the
chunks each had in flight (they add up to `busy_s`): the fair time base for a per-direction bandwidth when reads
and writes run at once. Queue depths are the kernel's to count (/proc/diskstats; benchmarks/disk_reference.py).
"""

from __future__ import annotations

import threading
import time


class IoStats:
    """Counters of one store; any thread. Lives as long as the store."""

    def __init__(self) -> None:
        # Guards every field below. Time is read under it, so chunk starts and ends are accounted in time order.
        self._lock = threading.Lock()
        self._bytes = {"read": 0, "write": 0}
        self._busy = {"read": 0.0, "write": 0.0}
        self._inflight = {"read": 0, "write": 0}
        self._since = {"read": 0.0, "write": 0.0}
        self._inflight_any = 0
        self._since_any = 0.0
        self._busy_any = 0.0
        self._mark = 0.0  # the last chunk start or end: the shares are accounted up to here
        self._share = {"read": 0.0, "write": 0.0}
        self._direct_bytes = 0
        self._fallbacks = 0

    def start(self, kind: str) -> None:
        """A chunk of direction `kind` ("read" | "write") begins."""
        with self._lock:
            self._account(time.perf_counter(), kind, +1)

    def end(self, kind: str, moved: int, moved_direct: int) -> None:
        """The chunk ends, having moved `moved` bytes, `moved_direct` of them through O_DIRECT (also on failure)."""
        with self._lock:
            self._account(time.perf_counter(), kind, -1)
            self._bytes[kind] += moved
            self._direct_bytes += moved_direct

    def fallback(self) -> None:
        """A file refused O_DIRECT at a transfer and went buffered for good."""
        with self._lock:
            self._fallbacks += 1

    def snapshot(self) -> dict:
        """What `NvmeStore.stats` returns, up to now (see the module docstring)."""
        now = time.perf_counter()
        with self._lock:
            busy = {k: self._busy[k] + (now - self._since[k] if self._inflight[k] else 0.0) for k in self._busy}
            n = self._inflight_any
            share = {k: self._share[k] + ((now - self._mark) * self._inflight[k] / n if n else 0.0)
                     for k in self._share}
            out = {
                "bytes_read": self._bytes["read"],
                "bytes_written": self._bytes["write"],
                "read_busy_s": busy["read"],
                "write_busy_s": busy["write"],
                "busy_s": self._busy_any + (now - self._since_any if n else 0.0),
                "read_share_s": share["read"],
                "write_share_s": share["write"],
                "direct_bytes": self._direct_bytes,
                "buffered_bytes": self._bytes["read"] + self._bytes["write"] - self._direct_bytes,
                "direct_fallbacks": self._fallbacks,
            }
        out["read_Bps"] = out["bytes_read"] / busy["read"] if busy["read"] else 0.0
        out["write_Bps"] = out["bytes_written"] / busy["write"] if busy["write"] else 0.0
        return out

    def _account(self, now: float, kind: str, delta: int) -> None:
        """Under _lock: account busy time and each direction's share of it up to `now`, then change the number of
        `kind` chunks in flight by `delta` (+1 at a chunk's start, -1 at its end)."""
        n = self._inflight_any
        if n:
            for k in self._share:
                self._share[k] += (now - self._mark) * self._inflight[k] / n
        else:
            self._since_any = now
        self._mark = now
        if not self._inflight[kind]:
            self._since[kind] = now
        self._inflight[kind] += delta
        self._inflight_any += delta
        if not self._inflight[kind]:
            self._busy[kind] += now - self._since[kind]
        if not self._inflight_any:
            self._busy_any += now - self._since_any
