"""One cache of host buffers that hold a unit's state ahead of, or past, the transfer that would move it again.

Why one cache: each of these saves a transfer, and each used to be a field of its own with its own room check:
- (unit, "params"): the unit's fp32 params, which are its master when compute is fp32 and both share a tier
  ([Note: master from the fetch], flat_unit.py). Put by a backward fetch from disk (its staging buffer: the unit's
  step then reads no master) and by a step (the buffer it just updated, on its way to disk: the next forward's
  fetch copies from it instead of reading the disk).
- (unit, "grads"): a unit's final gradients of the backward before a step, instead of a round trip to disk.
- (unit, master entry / "exp_avg" / "exp_avg_sq"): master and moments loading under the unit's backward for the
  step that follows it (`optim_step.preload`).

An entry holds one pool buffer, the unit's parameter version it holds values of (`OffloadUnit.version`: +1 per
optimizer step of the unit and per new values written to it; a `take` of another version finds nothing and drops
the stale entry), and the transfers still touching the buffer: `ready`, a load filling it (a user waits for it),
and `reading`, a write-back reading it (a user that modifies it waits for it; giving it back waits for it).

[Note: host cache admission] One rule, `admit`: an entry is taken only while the pool keeps `reserve` bytes free
beside it, the largest unit's step working set. Whatever is held, the step of any unit can then take what it
still needs once the transfers in flight return their buffers, and each stepped unit returns its own: holding
ahead never starves the step that alone releases what is held. A step that still finds the pool short (transfers
that hold nothing ahead took the room meanwhile) first gives up the entries of the other units (`evict_others`):
they are stepped after it, so waiting for them would never end (tests/test_offload_tight_host.py). Held
gradients are the one exception: no tier has them, so they are never evicted (`only_copy`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from tightfit.offload.runtime.host_memory import BufferPool


@dataclass
class Held:
    """One cached buffer: the values of a unit's entry at `version`, and the transfers still touching it."""

    buf: torch.Tensor
    version: int
    ready: Future | None = None  # a load filling `buf`
    reading: Future | None = None  # a write-back reading `buf`
    only_copy: bool = False  # no tier holds these values (held gradients): never evicted, only consumed or dropped

    def pending(self) -> list[Future]:
        return [f for f in (self.ready, self.reading) if f is not None]


class HostCache:
    """(unit, entry) -> Held, for every unit of one engine; any thread."""

    def __init__(self, pool: BufferPool, reserve: int) -> None:
        self.pool = pool
        self.reserve = reserve  # [Note: host cache admission]
        self._entries: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()

    def admit(self, nbytes: int) -> bool:
        """May an entry of `nbytes` be held now? ([Note: host cache admission])"""
        return self.pool.has_room(nbytes + self.reserve)

    def put(self, unit: str, entry: str, held: Held) -> None:
        with self._lock:
            old = self._entries.pop((unit, entry), None)
            self._entries[(unit, entry)] = held
        if old is not None:
            self._release(old)

    def holds(self, unit: str, entry: str, version: int) -> bool:
        with self._lock:
            held = self._entries.get((unit, entry))
            return held is not None and held.version == version

    def take(self, unit: str, entry: str, version: int) -> Held | None:
        """Remove and return the entry if it holds `version` (the caller owns its buffer now); drop it if stale."""
        with self._lock:
            held = self._entries.pop((unit, entry), None)
        if held is not None and held.version != version:
            self._release(held)
            return None
        return held

    def held_bytes(self, unit: str) -> int:
        with self._lock:
            return sum(h.buf.numel() * h.buf.element_size() for (u, _), h in self._entries.items() if u == unit)

    def drop(self, unit: str, keep: tuple[str, ...] = ()) -> None:
        """Give back the unit's entries except those named in `keep`."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == unit and k[1] not in keep]
            helds = [self._entries.pop(k) for k in gone]
        for held in helds:
            self._release(held)

    def evict_others(self, unit: str, need: int) -> None:
        """Give back other units' entries until the pool has room for `need` bytes ([Note: host cache admission])."""
        with self._lock:
            others = [k for k, h in self._entries.items() if k[0] != unit and not h.only_copy]
        for key in others:
            if self.pool.has_room(need):
                return
            with self._lock:
                held = self._entries.pop(key, None)
            if held is not None:
                self._release(held)
                wait(held.pending())  # its buffer is back once the transfers touching it are done

    def clear(self) -> None:
        with self._lock:
            helds, self._entries = list(self._entries.values()), {}
        for held in helds:
            self._release(held)

    def _release(self, held: Held) -> None:
        """Back to the pool once nothing touches the buffer any more (without waiting here)."""
        pending = [f for f in held.pending() if not f.done()]
        if not pending:
            self.pool.give(held.buf)
        elif len(pending) == 1:
            self.pool.give_after(pending[0], held.buf)
        else:
            both: Future = Future()
            remaining = [len(pending)]
            lock = threading.Lock()

            def one_done(_f) -> None:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    both.set_result(None)

            for f in pending:
                f.add_done_callback(one_done)
            self.pool.give_after(both, held.buf)
