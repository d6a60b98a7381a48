"""Moving bytes between tier stores and the compute device: the bounded host buffer pool and two movers.

Why a mover object: the schedule is the same on every machine, only "copy these bytes to the device" differs.
`CpuMover` (no GPU: the device is the CPU with a budget) runs copies on a small thread pool; `CudaMover` runs them
on dedicated CUDA streams through pinned staging buffers, ordered with events. The engine picks one at wrap time
and never tests the device type again.

[Note: staging memory] Every host buffer the engine needs for a transfer or an optimizer step comes from one
`BufferPool` with a byte capacity (what the host budget leaves after the host tier itself). `take` blocks when the
pool is exhausted until another transfer returns a buffer: that back-pressure is what keeps peak host memory
within budget however far ahead the schedule runs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tightfit.errors import UsageError
from tightfit.offload.aligned import aligned_empty
from tightfit.offload.tiers import TierStore, done_future


class BufferPool:
    """Reusable 1-D host buffers (4096-byte aligned for O_DIRECT; pinned on CUDA), at most `capacity` bytes."""

    def __init__(self, capacity: int | None, pin: bool = False) -> None:
        self.capacity = capacity
        self.pin = pin
        # (numel, dtype) -> idle buffers. Kept for reuse; dropped (freed) only to make room for another size.
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._cond = threading.Condition()
        self.bytes = 0  # bytes allocated (idle + lent)
        self.peak = 0

    @staticmethod
    def _size(numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        need = self._size(numel, dtype)
        if self.capacity is not None and need > self.capacity:
            raise UsageError(f"host budget: a {need} B staging buffer does not fit the {self.capacity} B left for "
                             "staging; raise --cpu-mem or use smaller units")
        with self._cond:
            while True:
                idle = self._free.get((numel, dtype))
                if idle:
                    return idle.pop()
                if self.capacity is None or self.bytes + need <= self.capacity:
                    break
                # Free idle buffers of other sizes before waiting for a lent one to come back.
                victims = [(k, lst) for k, lst in self._free.items() if lst]
                if victims:
                    k, lst = victims[0]
                    lst.pop()
                    self.bytes -= self._size(*k)
                    continue
                self._cond.wait()
            self.bytes += need
            self.peak = max(self.peak, self.bytes)
        return aligned_empty(numel, dtype, pin=self.pin)

    def room(self) -> int | None:
        """Bytes a `take` could get now without waiting (idle buffers count: they can be dropped); None: no cap."""
        if self.capacity is None:
            return None
        with self._cond:
            idle = sum(len(lst) * self._size(*k) for k, lst in self._free.items())
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
        with self._cond:
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            self._cond.notify_all()

    def give_after(self, fut: Future, buf: torch.Tensor) -> None:
        """Return `buf` once `fut` is done. The callback holds the buffer only until then: a Future keeps its
        callbacks as long as it lives, and a buffer the pool has since dropped must not stay allocated through one."""
        box = [buf]
        fut.add_done_callback(lambda _f: self.give(box.pop()))

    def clear(self) -> None:
        with self._cond:
            for (numel, dtype), lst in self._free.items():
                self.bytes -= len(lst) * self._size(numel, dtype)
            self._free.clear()


class CpuMover:
    """No GPU: the "device" is host memory with a budget, so a fetch is a memcpy or a disk read into place."""

    def __init__(self, pool: BufferPool, threads: int = 2) -> None:
        self.pool = pool
        # Copy threads: a host-tier fetch (memcpy of a unit's params into its device buffer) runs here, overlapping
        # the compute of the unit before it. torch's copy releases the GIL. Shut down by `close`.
        self.copier = ThreadPoolExecutor(threads, thread_name_prefix="tightfit-copy")

    def fetch(self, store: TierStore, unit: str, entry: str, dst: torch.Tensor, keep_staging: bool = False) -> Future:
        """Start filling `dst` from the store. keep_staging: when the bytes pass through a staging buffer (a disk
        read), hand that buffer to the caller through `wait` instead of returning it to the pool."""
        src = store.tensor(unit, entry)
        if src is not None:
            def copy() -> None:
                dst.copy_(src)

            return self.copier.submit(copy)
        # Disk: read into an aligned staging buffer (O_DIRECT needs 4096-byte aligned memory, which the allocator
        # behind `dst` does not give), then copy into place.
        # The copy is queued once the read is done, so no copy thread sits blocked on the disk while gradient packs
        # and other copies wait behind it.
        staging = self.pool.take(dst.numel(), dst.dtype)
        read = store.load(unit, entry, staging, urgent=True)
        fetched: Future = Future()
        fetched.set_running_or_notify_cancel()
        # The buffer is handed over in a box that the copy empties: a Future keeps its done-callbacks (and so these
        # closures) as long as it lives, and naming the read future inside them made a reference cycle that only
        # the cyclic collector broke. Until it did, a staging buffer given back to the pool and later dropped by
        # it for another size stayed allocated, unseen by any meter (13-27 MiB measured with 14 MB units).
        box = [staging]
        del staging

        def copy(done: Future) -> None:
            buf = box.pop()
            try:
                done.result()
                dst.copy_(buf)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the fetch
                self.pool.give(buf)
                fetched.set_exception(e)
                return
            if keep_staging:
                fetched.set_result(buf)
            else:
                self.pool.give(buf)
                fetched.set_result(None)

        def queue_copy(done: Future) -> None:
            try:
                self.copier.submit(copy, done)
            except RuntimeError as e:  # the mover was closed while the read was in flight
                self.pool.give(box.pop())
                fetched.set_exception(e)

        read.add_done_callback(queue_copy)
        return fetched

    def wait(self, fut: Future) -> torch.Tensor | None:
        """Wait for a fetch; the staging buffer it kept (a pool buffer the caller now owns), or None."""
        return fut.result()

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor, after: Future) -> Future:
        """Fill `dst` from `src`, a pool buffer that goes back to the pool once copied and `after` is done."""
        def copy() -> None:
            dst.copy_(src)
            # The write-back reads `src` too: the buffer goes back when that is done, without holding this thread.
            self.pool.give_after(after, src)

        return self.copier.submit(copy)

    def pack_grads(self, grads: list[tuple[tuple[int, torch.Size], torch.Tensor]], numel: int) -> Future:
        """Copy gradients into one pooled fp32 host buffer of `numel` elements; the future gives the buffer.

        `grads` pairs a slot's (offset, shape) in the unit's flat layout with its gradient; the buffer gets each
        gradient at that offset (regions of slots without a gradient are left unwritten)."""
        # The buffer is taken here, on the caller's thread: a full pool holds backward back (the back-pressure of
        # [Note: staging memory]), never a copy thread that a fetch's copy, returning a buffer, may be queued behind.
        # The copy runs on a copy thread, off the thread that runs backward; `grads` stay alive until it is done.
        buf = self.pool.take(numel, torch.float32)

        def pack() -> torch.Tensor:
            for view, g in grads:
                _region(buf, view).copy_(g)
            return buf

        return self.copier.submit(pack)

    def close(self) -> None:
        self.copier.shutdown(wait=True)


def _region(buf: torch.Tensor, view_like: tuple[int, torch.Size]) -> torch.Tensor:
    offset, shape = view_like
    return buf[offset : offset + shape.numel()].view(shape)


class CudaMover:
    """GPU: pinned staging buffers, a host-to-device and a device-to-host stream, events for ordering.

    Hot path (the main thread): only enqueues copies and `wait_event`s; it never synchronises with the GPU.
    Waiting for a copy to finish before a staging buffer is reused happens on the `waiter` thread.
    """

    def __init__(self, pool: BufferPool, device: torch.device, threads: int = 2) -> None:
        self.pool = pool
        self.device = device
        # h2d: parameter fetches (overlap the compute of the units before). d2h: gradient copies out (overlap the
        # backward of the units after). Both live as long as the engine.
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        # Waiter threads: block on disk reads and on copy events so staging buffers go back to the pool as soon as
        # a copy is done, without the main thread ever synchronising. Shut down by `close`.
        self.waiter = ThreadPoolExecutor(threads, thread_name_prefix="tightfit-cuda-wait")

    def fetch(self, store: TierStore, unit: str, entry: str, dst: torch.Tensor, keep_staging: bool = False) -> Future:
        """As CpuMover.fetch; staging buffers are never kept here (`keep_staging` is ignored)."""
        # `dst` was (re)allocated on the compute stream; the copy must not start before that point of it.
        alloc = torch.cuda.Event()
        alloc.record(torch.cuda.current_stream(self.device))
        src = store.tensor(unit, entry)
        if src is not None:  # pinned host (or device) memory: one async copy
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(alloc)
                dst.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.h2d)
            return done_future(ready)
        staging = self.pool.take(dst.numel(), dst.dtype)
        read = store.load(unit, entry, staging, urgent=True)

        def then() -> torch.cuda.Event:
            read.result()
            with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
                self.h2d.wait_event(alloc)
                dst.copy_(staging, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.h2d)
            ready.synchronize()  # waiter thread only: the staging buffer is free once the copy has run
            self.pool.give(staging)
            return ready

        return self.waiter.submit(then)

    def wait(self, fut: Future) -> None:
        # A host wait only for the disk read, never for the GPU: the compute stream waits on the copy's event.
        torch.cuda.current_stream(self.device).wait_event(fut.result())
        return None

    def pack_grads(self, grads: list[tuple[tuple[int, torch.Size], torch.Tensor]], numel: int) -> Future:
        buf = self.pool.take(numel, torch.float32)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(produced)
            for view, g in grads:
                _region(buf, view).copy_(g, non_blocking=True)
                # The caller drops param.grad right after this call; the allocator must not reuse its memory until
                # the d2h stream has read it.
                g.record_stream(self.d2h)
            copied = torch.cuda.Event()
            copied.record(self.d2h)

        def then() -> torch.Tensor:
            copied.synchronize()
            return buf

        return self.waiter.submit(then)

    def close(self) -> None:
        self.waiter.shutdown(wait=True)
