"""Moving bytes between the tier stores and the compute device: one contract, a CPU and a CUDA implementation.

Why one contract: the schedule is the same on every machine, only "copy these bytes to the device" differs. When
the CPU mover completed every copy before returning and the CUDA mover did not, the CPU test suite could not see
the ordering bugs a GPU hits (a buffer freed while a copy still writes it, a staging buffer reused while a copy
still reads it). Both movers now hand out the same `Transfer` and follow the same rules, and the CPU mover can
complete copies late on purpose and check the rules (`strict`), which is how the test suite runs.

[Note: the mover contract]
1. `fetch(store, unit, entry, dst, staging)` starts filling `dst` (a unit's device buffer) and returns a `Transfer`;
   from a tier that is not addressable memory the bytes pass through `staging`, a buffer of the caller's grant
   (runtime/host_memory.py). Nothing reads `dst` before `wait(transfer)`; nothing frees it before `wait` or
   `cancel`.
2. `wait(transfer)` orders the compute after the copy. CUDA: the host waits only for a disk read still running (a
   copy cannot be issued before its bytes are in host memory), then the compute stream waits on the copy's event;
   the host never waits for the GPU. CPU: the compute "stream" is the host thread, so it waits for the copy.
3. `cancel(transfer)`: `dst` is about to be freed. A copy not yet issued is dropped; one already issued is ordered
   before whatever the compute stream does next (CUDA: an event wait, no host sync; CPU: the host waits for it).
4. `pack_grads(grads, buf, before=None)` starts copying gradients into `buf` (a granted host buffer, or the host
   tier's page-locked sum: [Note: gradients land converted] in step/gradients.py), converted to its dtype on the way
   (on CUDA on the device, `CONVERT_CHUNK` elements at a time); the transfer's `done` completes once the host may
   read it (CUDA: after the copy's event, seen by the one completion thread). The gradients stay alive until the
   copy has read them. `before()`, where given, runs first in the copy's order (the copy thread; CUDA: with the copy
   stream current): what finishes writing the gradients, their average over the ranks.
5. The mover owns no host buffer. Whoever granted one gives it back after the `done` of every transfer that touches
   it (`Grant.give(name, after=t.done)`); `done` completes also when the read failed or the fetch was cancelled,
   and only then is nothing touching the buffer any more.
6. The host waits for a device copy to complete only through `sync`, which counts it (`stats`): the engine does so
   only in backward under a tight device budget, never in forward.

[Note: device writes in stream order] A store's copy into device memory (`copy_async(..., into_device=True)`: a
step's new params written back into the device tier) is ordered on a GPU before everything issued after it: the
compute stream waits on the copy's event at once, so the next forward reads the new values, and a later copy
out of the device reads them too. The CPU mover keeps the same order: every later `copy_async` waits for the
device writes issued before it, and `order_compute` (the engine calls it when a forward starts) waits for them
before the compute reads device memory. Without it a CPU device apart from host memory (`cpu:0`, the suite's
GPU-shaped path) read a step's params while its write-back was still copying them (the stress test's seed 41, one
run in seven once copies ran on one core).

Threads: CPU copies run on `copier` threads (torch's copy releases the GIL), each copy on one core ([Note: one
core per copy]). CUDA copies are issued on the `h2d`
and `d2h` streams, from the caller's thread or, for a disk fetch, from the NVMe thread that finished the read; one
`_Completions` thread waits for their events (blocking events: it sleeps, it does not spin on a core the CPU
optimizer needs) and runs what each completion unlocks.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import torch

from tightfit.offload.memory_model import CONVERT_CHUNK  # the plan counts its temporary ("grad conversion")
from tightfit.offload.runtime.host_memory import HostPool
from tightfit.offload.runtime.workers import set_own_threads
from tightfit.utils import ranges

if TYPE_CHECKING:
    from tightfit.offload.tiers.stores import TierStore


class MoverContractError(AssertionError):
    """A buffer was freed, reused or read while a transfer that touches it was pending (strict CPU mover)."""


class Transfer:
    """One asynchronous copy into or out of the device. `issued`: the copy is issued (CUDA: enqueued on its stream,
    `event` recorded) or was dropped; `done`: it is complete as the host sees it, with the host buffer it leaves
    (a pack) as result."""

    __slots__ = ("issued", "done", "event", "lock", "cancelled", "running")

    def __init__(self) -> None:
        self.issued: Future = Future()
        self.done: Future = Future()
        self.event = None  # CUDA only: recorded on the copy's stream
        self.lock = threading.Lock()  # orders issuing against cancelling
        self.cancelled = False
        self.running = False  # CPU only: the copy has started

    def fail(self, error: BaseException) -> None:
        for f in (self.issued, self.done):
            if not f.done():
                f.set_exception(error)


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _region(buf: torch.Tensor, view_like: tuple[int, torch.Size]) -> torch.Tensor:
    offset, shape = view_like
    return buf[offset : offset + shape.numel()].view(shape)


def _copy_converting(dst: torch.Tensor, g: torch.Tensor, chunk, same=None) -> None:
    """dst <- g (a gradient packed for the host, or an fp32 master uploaded for the device to cast). In one copy
    (`same`, default `chunk`) where the dtypes match; converted to dst's dtype `CONVERT_CHUNK` elements at a time
    (`chunk(dst_piece, g_piece)`) where they do not. One loop for both movers, so the CPU suite runs the chunks'
    arithmetic that bounds a GPU's temporary."""
    if dst.dtype == g.dtype:
        (same or chunk)(dst, g)
        return
    flat_dst, flat_g = dst.view(-1), g.reshape(-1)
    for a in range(0, flat_g.numel(), CONVERT_CHUNK):
        chunk(flat_dst[a:a + CONVERT_CHUNK], flat_g[a:a + CONVERT_CHUNK])


def strict_from_env() -> bool:
    """The strict CPU mover is on when TIGHTFIT_STRICT_MOVER is set to 1 (the test suite sets it)."""
    return os.environ.get("TIGHTFIT_STRICT_MOVER", "") == "1"


def strict_seed() -> int:
    """Seed of the strict mode's random delays (TIGHTFIT_STRICT_SEED; 0): a stress test runs many."""
    return int(os.environ.get("TIGHTFIT_STRICT_SEED", "0"))


class CpuMover:
    """No GPU: the "device" is host memory with a budget, so a fetch is a memcpy, or a disk read and a memcpy.

    strict: copies start late (after a random pause of up to `max_delay_s`), every pending copy's buffers are
    registered, a copy whose destination was freed or resized before it ran, and a pool buffer given back while a
    pending copy touches it, raise `MoverContractError` (on the caller's thread at once, or at the next mover call
    when a copy thread found it); the pool poisons lent and returned buffers."""

    def __init__(self, pool: HostPool, threads: int = 2, strict: bool = False, max_delay_s: float = 0.002,
                 seed: int = 0) -> None:
        self.pool = pool
        self.strict = strict
        self.max_delay_s = max_delay_s
        self._rng = random.Random(seed)
        # Copy threads: fetch copies and gradient packs, overlapping the compute of the units around them. Shut
        # down by `close`. [Note: one core per copy] A copy runs beside the compute, whose intra-op threads already
        # take every core: a copy with torch's default team (all cores) oversubscribes them, and each side's
        # OpenMP barrier waits for a thread the other has descheduled. On the 2-core VM a streamed unit of width
        # 128 cost 3.2 ms a micro-batch more than a resident one with copies on every core, 0.5 ms with one
        # (benchmarks/RESULTS.md, batch W). A memcpy is bound by memory, not by cores.
        self.copier = ThreadPoolExecutor(threads, thread_name_prefix="tightfit-copy",
                                         initializer=lambda: set_own_threads(1))
        self.stats: Counter = Counter()
        self._pending: dict[int, list[tuple[int, int]]] = {}  # id(transfer) -> (address, bytes) it touches
        self._writes: list[Future] = []  # copies into device memory not known done ([Note: device writes in ...])
        self._lock = threading.Lock()
        self.violations: list[str] = []
        if strict:
            pool.poison = True
            pool.guard = self._guard_give

    # ---- the contract ------------------------------------------------------------------------------------------

    def fetch(self, store: TierStore, unit: str, entry: str, dst: torch.Tensor,
              staging: torch.Tensor | None = None) -> Transfer:
        """Start filling `dst` from the store: directly from addressable memory, else read into `staging` (a
        granted buffer, 4096-byte aligned for O_DIRECT, of `dst`'s size and dtype) and copied from there."""
        self._raise_violations()
        t = Transfer()
        span = _span(dst)  # what `dst` is now: the copy checks it is still there when it runs
        src = store.tensor(unit, entry)
        if src is not None:
            self._issue(t, dst, span, src)
            return t
        if staging is None:
            raise ValueError(f"fetch of {unit}/{entry} from a tier that is not memory needs a staging buffer")
        # The copy is queued once the read is done, so no copy thread sits blocked on the disk.
        read = store.load(unit, entry, staging, urgent=True)
        box = [staging]  # emptied on use: the read future keeps this callback as long as it lives
        del staging

        def on_read(done: Future) -> None:
            buf = box.pop()
            if done.exception() is not None:
                t.fail(done.exception())
                return
            self._issue(t, dst, span, buf)

        read.add_done_callback(on_read)
        return t

    def wait(self, t: Transfer) -> None:
        """Order the compute after `t` (here: the host waits for it)."""
        self._raise_violations()
        with ranges.span("tightfit::wait"):  # compute blocked on a copy: what the profile shows as exposed
            t.done.result()
        self._raise_violations()

    def cancel(self, t: Transfer) -> None:
        """The destination of `t` is about to be freed: drop the copy if it has not started, else wait for it."""
        with t.lock:
            if not t.running and not t.done.done():
                t.cancelled = True
                self.stats["cancelled"] += 1
                return
        self.stats["cancel_waits"] += 1
        try:
            t.done.result()
        except BaseException:  # noqa: BLE001 - the fetch's error dies with the buffer it was filling
            pass

    def sync(self, t: Transfer):
        """The host waits for `t` to complete (counted: on CUDA this is a wait for the GPU)."""
        self.stats["host_waits_on_device"] += 1
        return t.done.result()

    def pack_grads(self, grads: list[tuple[tuple[int, torch.Size], torch.Tensor]], buf: torch.Tensor,
                   before=None) -> Transfer:
        """Copy gradients into `buf` (a granted host buffer, or the host tier's page-locked sum), converted to its
        dtype. `grads` pairs a slot's (offset, shape) in the unit's flat layout with its gradient; regions of slots
        without one are left unwritten. `before()`: what the copy waits for first, in its order (the gradients'
        average over the ranks: it finishes writing them)."""
        self._raise_violations()
        t = Transfer()
        self.stats["bytes_to_host"] += sum(g.numel() for _, g in grads) * buf.element_size()  # what lands on the host

        def pack() -> None:
            if before is not None:
                before()
            for view, g in grads:
                _copy_converting(_region(buf, view), g, lambda d, c: d.copy_(c))

        touches = [buf, *(g for _, g in grads)]
        self._run(t, pack, touches, [_span(x) for x in touches], label="tightfit::pack_grads")
        return t

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        """Fill `dst` (device memory) from `src`, a granted host buffer: its grant gives it back after `done`."""
        t = Transfer()
        self.stats["bytes_to_device"] += src.numel() * src.element_size()

        def copy() -> None:
            dst.copy_(src)

        self._run(t, copy, [dst, src], [_span(dst), _span(src)], label="tightfit::copy_in")
        return t

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, into_device: bool = False) -> Future:
        """A plain copy between two memories, off the caller's thread (a tier store's load or save); late, in strict
        mode, as a copy on a GPU's stream is. After every copy into device memory issued before it, and, when
        `into_device`, before every copy and compute issued after it ([Note: device writes in stream order])."""
        delay = self._rng.uniform(0, self.max_delay_s) if self.strict else 0.0
        before = self._device_writes()
        # A store's copy across the two memories is the device tier's: into it (a save) or out of it (a load).
        self.stats["bytes_to_device" if into_device else "bytes_to_host"] += dst.numel() * dst.element_size()

        def copy() -> None:
            wait_futures(before)  # issued earlier, so queued ahead of this one: never a wait on a later copy
            if delay:
                time.sleep(delay)
            dst.copy_(src)

        fut = self.copier.submit(copy)
        if into_device:
            with self._lock:
                self._writes.append(fut)
        return fut

    def order_compute(self) -> None:
        """The compute that comes next reads device memory after the copies into it issued so far (as a GPU's
        compute stream waits on their events: [Note: device writes in stream order])."""
        wait_futures(self._device_writes())

    def _device_writes(self) -> list[Future]:
        with self._lock:
            self._writes = [f for f in self._writes if not f.done()]
            return list(self._writes)

    def close(self) -> None:
        self.copier.shutdown(wait=True)
        self._raise_violations()

    # ---- the machinery -----------------------------------------------------------------------------------------

    def _issue(self, t: Transfer, dst: torch.Tensor, span: tuple[int, int], src: torch.Tensor) -> None:
        self.stats["bytes_to_device"] += src.numel() * src.element_size()  # what crosses: an fp32 master is 4 B

        def copy() -> None:
            _copy_converting(dst, src, lambda d, c: d.copy_(c))  # a master the device casts: as CudaMover, in chunks

        self._run(t, copy, [dst, src], [span, _span(src)], label="tightfit::fetch")

    def _run(self, t: Transfer, fn, touches: list[torch.Tensor], spans: list[tuple[int, int]],
             label: str = "tightfit::copy") -> None:
        """Run `fn` on a copy thread (late, in strict mode), unless `t` is cancelled before it starts. `spans`: each
        touched tensor's storage (address, bytes) when the transfer was started; a copy whose buffer has changed
        since fails (always: copying into freed memory would not fail, it would corrupt)."""
        if self.strict:
            with self._lock:
                self._pending[id(t)] = spans
        delay = self._rng.uniform(0, self.max_delay_s) if self.strict else 0.0
        if not t.issued.done():
            t.issued.set_result(None)
        # The copy's tensors, emptied before `done` is set: a finished (or cancelled) copy holds nothing, so a source
        # the caller has let go of is freed when its copy is done, not when the copy thread next looks up (what
        # CUDA's `record_stream` gives: the block is free once the stream's work on it completes).
        job = [fn, touches]
        del fn, touches

        def run() -> None:
            if delay:
                time.sleep(delay)
            with t.lock:
                if t.cancelled:
                    job.clear()
                    self._forget(t)
                    t.done.set_result(None)
                    return
                t.running = True
            copy, touched = job
            job.clear()
            try:
                self._check_alive(touched, spans)
                with ranges.span(label):  # a profiler range (--profile), free otherwise
                    copy()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the transfer
                del copy, touched  # the traceback keeps this frame
                self._forget(t)
                t.fail(e)
                return
            del copy, touched
            self._forget(t)
            t.done.set_result(None)

        try:
            self.copier.submit(run)
        except RuntimeError as e:  # the mover was closed while a disk read was in flight
            self._forget(t)
            t.fail(e)

    def _check_alive(self, touches: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
        for x, (ptr, nbytes) in zip(touches, spans):
            s = x.untyped_storage()
            if s.data_ptr() != ptr or s.nbytes() < nbytes:
                msg = (f"a copy ran into a buffer freed or resized while the copy was pending ({nbytes} B at "
                       f"{ptr:#x}, now {s.nbytes()} B): free only after wait() or cancel()")
                self.violations.append(msg)
                raise MoverContractError(msg)

    def _forget(self, t: Transfer) -> None:
        if self.strict:
            with self._lock:
                self._pending.pop(id(t), None)

    def _guard_give(self, buf: torch.Tensor) -> None:
        """Pool guard (strict): a buffer goes back only when no pending copy touches it."""
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        with self._lock:
            busy = any(p < hi and lo < p + n for spans in self._pending.values() for p, n in spans)
        if busy:
            msg = f"a pool buffer ({hi - lo} B at {lo:#x}) was given back while a pending copy touches it"
            self.violations.append(msg)
            raise MoverContractError(msg)

    def _raise_violations(self) -> None:
        if self.violations:
            raise MoverContractError("; ".join(self.violations))


class _Completions:
    """The one thread that waits for CUDA events, in the order they were recorded, and runs what each completion
    unlocks (returning a staging buffer, handing a gradient pack to the gradient worker). Stopped by `close`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tightfit-cuda-completions", daemon=True)
        self._thread.start()

    def add(self, event, fn) -> None:
        self._queue.put((event, fn))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, fn = item
            event.synchronize()  # a blocking event: the thread sleeps until the GPU gets there
            fn()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CudaMover:
    """GPU: page-locked staging granted by the pool, a host-to-device and a device-to-host stream, events for ordering.

    Hot path (the thread running forward or backward): only issues copies and `wait_event`s; it never waits for
    the GPU. A transfer's `done` is completed by the completion thread once its copy's event is reached.
    """

    def __init__(self, pool: HostPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        # h2d: parameter fetches and uploads of refreshed compute params (overlap the compute of the units before).
        # d2h: gradient packs and the tier stores' device-to-host copies (overlap the backward of the units after,
        # and the optimizer). Both live as long as the engine.
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.completions = _Completions()
        self.stats: Counter = Counter()

    def _event(self):
        return torch.cuda.Event(blocking=True)

    def fetch(self, store: TierStore, unit: str, entry: str, dst: torch.Tensor,
              staging: torch.Tensor | None = None) -> Transfer:
        """As CpuMover.fetch."""
        t = Transfer()
        # `dst` was (re)allocated on the compute stream; the copy must not start before that point of it.
        alloc = self._event()
        alloc.record(torch.cuda.current_stream(self.device))
        src = store.tensor(unit, entry)
        if src is not None:  # page-locked host (or device) memory: one async copy, issued now
            self._issue(t, dst, src, alloc)
            return t
        if staging is None:
            raise ValueError(f"fetch of {unit}/{entry} from a tier that is not memory needs a staging buffer")
        read = store.load(unit, entry, staging, urgent=True)
        box = [staging]
        del staging

        def on_read(done: Future) -> None:  # an NVMe thread
            buf = box.pop()
            if done.exception() is not None:
                t.fail(done.exception())
                return
            self._issue(t, dst, buf, alloc)

        read.add_done_callback(on_read)
        return t

    def _issue(self, t: Transfer, dst: torch.Tensor, src: torch.Tensor, alloc) -> None:
        with t.lock:
            if t.cancelled:
                t.issued.set_result(None)
                t.done.set_result(None)
                return
            self._upload(t, dst, src, alloc)
        self.completions.add(t.event, lambda: t.done.set_result(None))

    def _upload(self, t: Transfer, dst: torch.Tensor, src: torch.Tensor, after_event) -> None:
        """Issue `dst <- src` on the h2d stream after `after_event`; record its event on `t`, mark `t` issued."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d), ranges.span("tightfit::upload"):
            self.h2d.wait_event(after_event)
            # An fp32 master the device casts ([Note: the device casts the master] in step/unit.py) goes up a chunk
            # at a time into a temporary on this stream and is cast from there (a copy_ across devices and dtypes
            # would cast the whole of it on the host first); the allocator reuses a freed temporary only for a
            # later allocation on this stream, after the cast that read it.
            _copy_converting(dst, src, lambda d, c: d.copy_(c.to(d.device, non_blocking=True)),
                             same=lambda d, c: d.copy_(c, non_blocking=True))
            t.event = self._event()
            t.event.record(self.h2d)
        t.issued.set_result(None)
        self.stats["bytes_to_device"] += src.numel() * src.element_size()

    def wait(self, t: Transfer) -> None:
        t.issued.result()  # a disk read still running: host memory, not the GPU
        torch.cuda.current_stream(self.device).wait_event(t.event)

    def cancel(self, t: Transfer) -> None:
        with t.lock:
            if not t.issued.done():
                t.cancelled = True  # issued never: `done` completes when the read's callback sees this
                self.stats["cancelled"] += 1
                return
        if t.event is not None:  # the memory goes back to the compute stream's pool after the copy
            torch.cuda.current_stream(self.device).wait_event(t.event)

    def sync(self, t: Transfer):
        self.stats["host_waits_on_device"] += 1
        return t.done.result()

    def pack_grads(self, grads: list[tuple[tuple[int, torch.Size], torch.Tensor]], buf: torch.Tensor,
                   before=None) -> Transfer:
        # `before()`: runs with the d2h stream current, so the copies wait for what it orders there (an average's
        # all-reduce: its work's wait() orders the current stream after it).
        # Into `buf`'s dtype: a gradient converted (fp32 sums) goes a chunk at a time through a temporary on the d2h
        # stream, so the device holds at most CONVERT_CHUNK elements more than autograd's gradients (a copy_ across
        # devices and dtypes would convert the whole gradient at once). The allocator reuses a freed temporary only
        # for a later allocation on the same stream, after the copy that read it.
        t = Transfer()
        produced = self._event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h), ranges.span("tightfit::pack_grads"):
            self.d2h.wait_event(produced)
            if before is not None:
                before()
            for view, g in grads:
                _copy_converting(_region(buf, view), g,
                                 lambda d, c: d.copy_(c.to(d.dtype), non_blocking=True),
                                 same=lambda d, c: d.copy_(c, non_blocking=True))
                # The caller drops param.grad right after this call; the allocator must not reuse its memory until
                # the d2h stream has read it.
                g.record_stream(self.d2h)
            ev = self._event()
            ev.record(self.d2h)
        t.event = ev
        t.issued.set_result(None)
        self.stats["bytes_to_host"] += sum(g.numel() for _, g in grads) * buf.element_size()  # what lands on the host
        self.completions.add(ev, lambda: t.done.set_result(None))
        return t

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        """As CpuMover.copy_in: `src` is a page-locked granted buffer; the copy is issued now, after the compute
        stream's work so far (earlier users of `dst`)."""
        t = Transfer()
        users = self._event()
        users.record(torch.cuda.current_stream(self.device))
        self._upload(t, dst, src, users)
        self.completions.add(t.event, lambda: t.done.set_result(None))
        return t

    def order_compute(self) -> None:
        """Nothing to do: `copy_async` made the compute stream wait for a copy into device memory when it issued it
        ([Note: device writes in stream order])."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, into_device: bool = False) -> Future:
        """A tier store's copy between device and host memory (device-tier states of a step on the CPU), on the d2h
        or h2d stream after the compute stream's work so far; the future completes from the completion thread. No
        thread blocks on the copy: the caller waits for the future when it needs the bytes."""
        fut: Future = Future()
        to_device = dst.device.type == "cuda"
        stream = self.h2d if to_device else self.d2h
        ready = self._event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            for x in (dst, src):
                if x.device.type == "cuda":
                    x.record_stream(stream)
            ev = self._event()
            ev.record(stream)
        if to_device:  # what computes with (or reads back) the device copy next is ordered after it
            torch.cuda.current_stream(self.device).wait_event(ev)
        self.stats["bytes_to_device" if to_device else "bytes_to_host"] += dst.numel() * dst.element_size()
        self.completions.add(ev, lambda: fut.set_result(None))
        return fut

    def close(self) -> None:
        self.completions.close()
