"""Host staging memory: the bounded buffer pool every transfer and optimizer step draws from, and its allocators.

[Note: staging memory] Every host buffer the engine needs for a transfer or an optimizer step comes from one
`BufferPool` with a byte capacity (what the host budget leaves after the host tier itself). `take` blocks when the
pool is exhausted until another transfer returns a buffer: that back-pressure is what keeps peak host memory
within budget however far ahead the schedule runs.

[Note: metering what the allocator holds] The pool meters the bytes its allocator really holds, not the bytes it
asked for: `pool.bytes == allocator.held` at all times. That matters on CUDA, where torch's pinned allocator
(`torch.empty(..., pin_memory=True)`) rounds every request up to a power of two and never gives memory back, so a
pool counting `numel * itemsize` undercounted and "dropping" an idle buffer freed nothing. The CUDA pool uses
`RegisteredAllocator` instead: each buffer is its own page-aligned mapping, page-locked with `cudaHostRegister`
and unregistered when dropped, so what is counted is what is held, and a drop frees. Only buffers that take part
in asynchronous device copies (parameter staging, gradient packs) need page-locking at all; the host tier's
masters and moments never do (tiers.py).
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import torch

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import DIRECT_ALIGN, aligned_empty, mapped_empty


class HostAllocator:
    """Where a pool's buffers come from. `allocate` returns (buffer, bytes the process newly holds for it); `release`
    gives a buffer back and returns the bytes that really went back. `held` is the running total."""

    pinned = False

    def __init__(self) -> None:
        self.held = 0

    def allocate(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        buf = aligned_empty(numel, dtype)
        nbytes = numel * dtype.itemsize
        self.held += nbytes
        return buf, nbytes

    def cost(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes a new `allocate` of this size would add to `held` now."""
        return numel * dtype.itemsize

    def size_of(self, buf: torch.Tensor) -> int:
        """Bytes held for `buf`, one of this allocator's buffers."""
        return self.cost(buf.numel(), buf.dtype)

    def release(self, buf: torch.Tensor) -> int:
        nbytes = buf.numel() * buf.element_size()
        self.held -= nbytes
        return nbytes


class RegisteredAllocator(HostAllocator):
    """Page-locked buffers for asynchronous copies (CUDA): each one its own page-aligned mapping, registered with
    `cudaHostRegister` and unregistered when released, so it holds exactly its pages and frees them when dropped.
    `register(ptr, nbytes)` / `unregister(ptr)` default to the CUDA runtime's (tests pass recording stand-ins)."""

    pinned = True

    def __init__(self, register=None, unregister=None) -> None:
        super().__init__()
        self._register = register or _cuda_host_register
        self._unregister = unregister or _cuda_host_unregister

    @staticmethod
    def _pages(numel: int, dtype: torch.dtype) -> int:
        return -(-numel * dtype.itemsize // DIRECT_ALIGN) * DIRECT_ALIGN

    def allocate(self, numel, dtype):
        nbytes = self._pages(numel, dtype)
        buf = mapped_empty(numel, dtype)  # its own mapping: no page is shared with another registration
        self._register(buf.data_ptr(), nbytes)
        self.held += nbytes
        return buf, nbytes

    def cost(self, numel, dtype):
        return self._pages(numel, dtype)

    def release(self, buf):
        self._unregister(buf.data_ptr())
        nbytes = self._pages(buf.numel(), buf.dtype)
        self.held -= nbytes
        return nbytes


def _cuda_host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} B failed (error {int(err)})")


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class BufferPool:
    """Reusable 1-D host buffers (4096-byte aligned for O_DIRECT), at most `capacity` bytes held by the allocator.

    poison: fill every buffer with NaN (0xFF bytes) when it is lent and when it comes back, so a read of bytes a
    transfer has not written yet, or of a buffer after it was returned, shows up as NaNs in the results (the strict
    test mode, movers.py). `guard(buf)`, when set, is asked before a returned buffer becomes reusable: it raises if
    a transfer still touches it.
    """

    def __init__(self, capacity: int | None, allocator: HostAllocator | None = None, poison: bool = False) -> None:
        self.capacity = capacity
        self.allocator = allocator or HostAllocator()
        self.poison = poison
        self.guard = None
        # (numel, dtype) -> idle buffers. Kept for reuse; released only to make room for another size.
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        # Buffers lent out (weakly: a lent buffer that dies without coming back is a metering leak, `live_bytes`).
        self._lent: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._cond = threading.Condition()
        self.bytes = 0  # bytes the allocator holds for this pool (idle + lent), [Note: metering what ...]
        self.peak = 0

    @property
    def pin(self) -> bool:
        return self.allocator.pinned

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        need = self.allocator.cost(numel, dtype)
        if self.capacity is not None and need > self.capacity:
            raise UsageError(f"host budget: a {need} B staging buffer does not fit the {self.capacity} B left for "
                             "staging; raise --cpu-mem or use smaller units")
        with self._cond:
            while True:
                idle = self._free.get((numel, dtype))
                if idle:
                    buf = idle.pop()
                    break
                need = self.allocator.cost(numel, dtype)
                if self.capacity is None or self.bytes + need <= self.capacity:
                    buf, held = self.allocator.allocate(numel, dtype)
                    self.bytes += held
                    self.peak = max(self.peak, self.bytes)
                    break
                # Release idle buffers of other sizes before waiting for a lent one to come back.
                victim = next(((k, lst) for k, lst in self._free.items() if lst), None)
                if victim is not None:
                    self.bytes -= self.allocator.release(victim[1].pop())
                    continue
                if not self._lent:
                    raise UsageError(f"host budget: {self.bytes} B held by the staging allocator and none of it "
                                     f"lent, yet no room for {need} B more; raise --cpu-mem")
                self._cond.wait()
            self._lent[id(buf)] = buf
        if self.poison:
            _poison(buf)
        return buf

    def room(self) -> int | None:
        """Bytes a `take` could get now without waiting (idle buffers count: they can be released); None: no cap."""
        if self.capacity is None:
            return None
        with self._cond:
            idle = sum(self.allocator.size_of(b) for lst in self._free.values() for b in lst)
            return self.capacity - self.bytes + idle

    def has_room(self, nbytes: int) -> bool:
        """Could a `take` of `nbytes` get them now without waiting?"""
        room = self.room()
        return room is None or room >= nbytes

    def idle_buffers(self) -> list[torch.Tensor]:
        """The idle buffers (still the pool's), viewed as bytes. For measurements that must move bytes through
        the very memory the engine uses (the NVMe benchmark's raw reference); only while nothing takes from the
        pool, e.g. between training steps."""
        with self._cond:
            return [b.view(-1).view(torch.uint8) for lst in self._free.values() for b in lst]

    def give(self, buf: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard(buf)
        if self.poison:
            _poison(buf)
        with self._cond:
            self._lent.pop(id(buf), None)
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            self._cond.notify_all()

    def give_after(self, fut: Future, buf: torch.Tensor) -> None:
        """Return `buf` once `fut` is done. The callback holds the buffer only until then: a Future keeps its
        callbacks as long as it lives, and a buffer the pool has since dropped must not stay allocated through one."""
        box = [buf]
        fut.add_done_callback(lambda _f: self.give(box.pop()))

    def live_bytes(self) -> int:
        """Bytes of the buffers that exist now, idle or lent, as the allocator counts them. Equal to `bytes` unless
        a lent buffer died without coming back (then the pool meters memory that is gone)."""
        with self._cond:
            bufs = [b for lst in self._free.values() for b in lst] + list(self._lent.values())
        return sum(self.allocator.size_of(b) for b in bufs)

    def clear(self) -> None:
        with self._cond:
            for lst in self._free.values():
                for buf in lst:
                    self.bytes -= self.allocator.release(buf)
            self._free.clear()


def _poison(buf: torch.Tensor) -> None:
    buf.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
