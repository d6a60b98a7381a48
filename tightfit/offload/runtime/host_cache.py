"""One cache of host buffers that hold a unit's state ahead of, or past, the transfer that would move it again.

Why one cache: each of these saves a transfer, and each used to be a field of its own with its own room check:
- (unit, "params"): the unit's fp32 params, which are its master when compute is fp32 and both share a tier
  ([Note: master from the fetch], step/unit.py). Put by a backward fetch from disk (its staging buffer: the unit's
  step then reads no master) and by a step (the buffer it just updated, on its way to disk: the next forward's
  fetch copies from it instead of reading the disk).
- (unit, "grads"): a unit's final gradients of the backward before a step, instead of a round trip to disk.
- (unit, master entry / "exp_avg" / "exp_avg_sq"): master and moments loading ahead of the unit's step (the
  scheduler's preloads, step/scheduler.py).

An entry is a speculative grant of one buffer ([Note: speculative holdings], host_memory.py: the pool bounds what
all entries together hold, so holding ahead can never starve a job), the unit's parameter version it holds values
of (`OffloadUnit.version`: +1 per optimizer step of the unit and per new values written to it; a `take` of another
version finds nothing and drops the stale entry), and the transfers still touching the buffer: `ready`, a load
filling it (a user waits for it), and `reading`, a write-back reading it (a user that modifies it waits for it;
giving it back waits for it). `only_copy`: no tier holds these values (held gradients); dropping them loses them,
so only the step that consumes them, or `zero_grad`, drops them. `prefix`: only a leading part holds values (fp32
params read for a step up to their frozen tail): good for that step, not for a fetch of the whole params.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tightfit.offload.runtime.host_memory import Grant


@dataclass
class Held:
    """One cached buffer: the values of a unit's entry at `version`, and the transfers still touching it."""

    grant: Grant  # speculative, one buffer named after the entry
    version: int
    ready: Future | None = None  # a load filling the buffer
    reading: Future | None = None  # a write-back reading the buffer
    only_copy: bool = False
    prefix: int | None = None  # only the first `prefix` elements hold values (a step's read of a trainable prefix)

    @property
    def buf(self) -> torch.Tensor:
        (buf,) = self.grant.bufs.values()
        return buf

    def pending(self) -> list[Future]:
        return [f for f in (self.ready, self.reading) if f is not None]

    def release(self) -> None:
        """Back to the pool once nothing touches the buffer any more (without waiting here)."""
        self.grant.release(after=self.pending())


class HostCache:
    """(unit, entry) -> Held, for every unit of one engine; any thread."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()

    def put(self, unit: str, entry: str, held: Held) -> None:
        with self._lock:
            old = self._entries.pop((unit, entry), None)
            self._entries[(unit, entry)] = held
        if old is not None:
            old.release()

    def holds(self, unit: str, entry: str, version: int) -> bool:
        with self._lock:
            held = self._entries.get((unit, entry))
            return held is not None and held.version == version

    def take(self, unit: str, entry: str, version: int) -> Held | None:
        """Remove and return the entry if it holds `version` (the caller owns its grant now); drop it if stale."""
        with self._lock:
            held = self._entries.pop((unit, entry), None)
        if held is not None and held.version != version:
            held.release()
            return None
        return held

    def entries(self, unit: str) -> list[str]:
        """The entries held for `unit`, sorted (for reports and tests)."""
        with self._lock:
            return sorted(e for u, e in self._entries if u == unit)

    def drop(self, unit: str, keep: tuple[str, ...] = ()) -> None:
        """Give back the unit's entries except those named in `keep`."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == unit and k[1] not in keep]
            helds = [self._entries.pop(k) for k in gone]
        for held in helds:
            held.release()

    def clear(self) -> None:
        with self._lock:
            helds, self._entries = list(self._entries.values()), {}
        for held in helds:
            held.release()
