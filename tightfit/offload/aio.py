"""Linux native asynchronous I/O (io_submit / io_getevents) for the NVMe tier's O_DIRECT transfers.

Why: with a pool of threads each calling preadv/pwrite, a finished transfer starts the thread's next one only once
that thread holds the GIL again, so the disk's queue drains whenever Python code runs elsewhere (the training
step's hooks, the optimizer's bookkeeping). With native AIO the kernel holds the queue: transfers are handed over
in batches by one io_submit call and reaped in batches by one thread, so a burst of requests stays queued on the
disk however busy the interpreter is. Measured on the benchmark VM (1 GiB of 4 MiB O_DIRECT reads into huge-page
memory, beside a thread running Python): 8 preadv threads 1.1-1.4 GB/s, AIO with 8 in flight 2.3-2.4 GB/s, with
16 in flight 2.8-2.9 GB/s; quiet, both 3.1-3.3 GB/s (benchmarks/RESULTS.md). DeepSpeed's NVMe offload uses libaio
for the same reason.

How: the raw system calls through ctypes (glibc's `syscall`), so there is nothing to compile and no libaio to
install; ctypes releases the GIL inside each call. Only O_DIRECT transfers come here: buffered I/O through AIO
would run synchronously inside io_submit. Where the kernel or a sandbox refuses (`io_setup` fails, another
architecture, another OS), `AioQueue` raises OSError at construction and the store keeps its threads.

Ordering: transfers wait in one queue per priority class (io_queue.py's classes: fetches, then loads, then
write-backs) and at most `depth` are in the kernel at once, so an urgent read waits behind at most `depth`
transfers, as with `depth` threads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from collections import deque
from typing import Callable

from tightfit.offload.io_queue import CLASSES

# System call numbers (include/uapi/asm-generic/unistd.h and arch/x86/entry/syscalls/syscall_64.tbl).
_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
_PREAD, _PWRITE = 0, 1  # IOCB_CMD_PREAD, IOCB_CMD_PWRITE


class _Iocb(ctypes.Structure):
    """struct iocb (linux/aio_abi.h), little-endian layout: 64 bytes."""

    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32), ("aio_rw_flags", ctypes.c_int32),
                ("aio_lio_opcode", ctypes.c_uint16), ("aio_reqprio", ctypes.c_int16),
                ("aio_fildes", ctypes.c_uint32), ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64), ("aio_flags", ctypes.c_uint32),
                ("aio_resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    """struct io_event: the iocb's aio_data, the iocb's address, the result (bytes or -errno), res2."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def _syscall_table() -> dict[str, int]:
    if not sys.platform.startswith("linux") or sys.byteorder != "little":
        raise OSError(errno.ENOSYS, "native AIO: Linux on a little-endian CPU only")
    table = _SYSCALLS.get(platform.machine())
    if table is None:
        raise OSError(errno.ENOSYS, f"native AIO: no system call numbers for {platform.machine()}")
    return table


class AioQueue:
    """Up to `depth` O_DIRECT transfers in the kernel at once, the rest queued by class; one reaper thread.

    `submit(...)` returns at once. `started()` runs right before the transfer goes to the kernel (under the queue's
    lock: keep it short, and do not submit from it); `done(result)` runs on the reaper thread with the bytes moved
    or a negative errno, outside any lock of this queue (it may submit more).
    """

    def __init__(self, depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        table = _syscall_table()
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._nr = table
        self._ctx = ctypes.c_ulong(0)
        if self._sys("io_setup", ctypes.c_long(depth), ctypes.byref(self._ctx)) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"native AIO unavailable: io_setup: {os.strerror(err)}")
        self.depth = depth
        self._iocbs = (_Iocb * depth)()
        self._events = (_Event * depth)()
        self._slots: list[tuple[Callable, Callable] | None] = [None] * depth  # slot -> (started, done) in flight
        self._free = list(range(depth))
        self._queues: list[deque] = [deque() for _ in CLASSES]
        self._cond = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name=f"{name}-aio", daemon=True)
        self._reaper.start()

    def _sys(self, name: str, *args) -> int:
        return self._syscall(ctypes.c_long(self._nr[name]), *args)

    def submit(self, priority: int, write: bool, fd: int, addr: int, nbytes: int, offset: int,
               started: Callable[[], None], done: Callable[[int], None]) -> None:
        """Queue one transfer of `nbytes` between memory at `addr` and `fd` at `offset` (all 4096-aligned)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the AIO queue is shut down")
            self._queues[priority].append((write, fd, addr, nbytes, offset, started, done))
            failed = self._pump()
            self._cond.notify_all()
        self._report(failed)

    def _pump(self) -> list[tuple[Callable, int]]:
        """Hand queued transfers to the kernel while slots are free, most urgent first (under the lock).

        Returns the `done` callbacks of transfers the kernel refused at submission, with their -errno."""
        failed: list[tuple[Callable, int]] = []
        while True:
            batch: list[int] = []
            while self._free:
                queue = next((q for q in self._queues if q), None)
                if queue is None:
                    break
                write, fd, addr, nbytes, offset, started, done = queue.popleft()
                slot = self._free.pop()
                cb = self._iocbs[slot]
                ctypes.memset(ctypes.byref(cb), 0, ctypes.sizeof(cb))
                cb.aio_data = slot
                cb.aio_lio_opcode = _PWRITE if write else _PREAD
                cb.aio_fildes = fd
                cb.aio_buf = addr
                cb.aio_nbytes = nbytes
                cb.aio_offset = offset
                self._slots[slot] = (started, done)
                started()
                batch.append(slot)
            if not batch:
                return failed
            while batch:
                ptrs = (ctypes.POINTER(_Iocb) * len(batch))(*[ctypes.pointer(self._iocbs[s]) for s in batch])
                n = self._sys("io_submit", self._ctx, ctypes.c_long(len(batch)), ptrs)
                if n < 0:  # the first iocb was refused (e.g. EINVAL: this file takes no AIO): fail it, go on
                    failed.append((self._release(batch.pop(0)), -ctypes.get_errno()))
                    continue
                self._inflight += n
                batch = batch[n:]

    def _release(self, slot: int) -> Callable[[int], None]:
        started_done = self._slots[slot]
        assert started_done is not None
        self._slots[slot] = None
        self._free.append(slot)
        return started_done[1]

    @staticmethod
    def _report(results: list[tuple[Callable, int]]) -> None:
        for done, res in results:
            try:
                done(res)
            except BaseException:  # a callback's bug must not stop the reaper (every later transfer would hang)
                import traceback

                traceback.print_exc()

    def _reap(self) -> None:
        while True:
            with self._cond:
                while self._inflight == 0 and not (self._closed and not any(self._queues)):
                    self._cond.wait()
                if self._inflight == 0:  # shut down and drained
                    return
            n = self._sys("io_getevents", self._ctx, ctypes.c_long(1), ctypes.c_long(self.depth), self._events, None)
            if n < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise OSError(ctypes.get_errno(), "io_getevents failed")  # pragma: no cover - a kernel bug
            results = []
            with self._cond:
                for ev in self._events[:n]:
                    results.append((self._release(int(ev.data)), int(ev.res)))
                self._inflight -= n
                results += self._pump()
                self._cond.notify_all()
            self._report(results)

    def shutdown(self) -> None:
        """Let queued and in-flight transfers finish, stop the reaper, release the kernel context. Idempotent."""
        with self._cond:
            if self._closed and not self._reaper.is_alive():
                return
            self._closed = True
            self._cond.notify_all()
        if self._reaper is not threading.current_thread():
            self._reaper.join()
            self._sys("io_destroy", self._ctx)
