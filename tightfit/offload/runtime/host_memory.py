"""Host staging memory: the bounded pool every transfer and optimizer job draws its buffers from, granted per job.

[Note: jobs and grants] Every host buffer the engine needs beyond the host tier itself belongs to a *job*: fetch a
unit's params from disk (a staging buffer), ship a unit's gradients off the device (a pack, and an fp32
accumulator when they go to disk), step a unit (master, gradients, moments, a cast of the new compute params). A job
asks for its whole buffer set at once (`reserve`) and is granted all of it or nothing; it never asks again while it
holds a grant, and it returns the buffers it was granted when the transfers that touch them are done. So no thread
waits for a buffer while holding one, and a job that has its grant finishes on its own: it needs only copies, disk
I/O and compute. With a capacity of at least the largest single job (`wrap` refuses less: step/budget_checks.py),
every wait ends: the jobs holding the pool finish and give back, and the head of the queue fits.

[Note: speculative holdings] Some grants are held past their job, for a later one that may come: master and moments
loaded ahead of a unit's step, a unit's final gradients kept for its step instead of a round trip to disk, a step's
new params kept for the next forward's fetch (runtime/host_cache.py). Their release waits for that later job, which
may itself be waiting in the queue, so they would break the argument above. They are therefore bounded apart:
speculative grants together hold at most `capacity - largest_job`, and one is granted only when no job waits
(`try_reserve(speculative=True)`, `Grant.speculate`). Whatever they hold, `largest_job` bytes come back once the
firm jobs in flight finish, which is enough for any job. A job that takes a speculative holding over (a step using
its preloaded moments) keeps it counted as speculative until the rest of its set is granted (`reserve(adopt=...)`),
then it is firm.

[Note: no unbounded wait] A reservation waits at most `wait_limit_s` (TIGHTFIT_WAIT_LIMIT_S, default 600 s); past it
`EngineStall` names the job, what it waits for and every grant holding the pool. With the notes above this never
happens; the limit turns a bug into an error instead of a hang.

[Note: metering what the allocator holds] The pool meters the bytes its allocator really holds, not the bytes it
asked for: `pool.bytes == allocator.held` at all times. On CUDA, torch's pinned allocator rounds every request up to
a power of two and never gives memory back, so the CUDA pool uses `RegisteredAllocator` instead: each buffer is its
own page-aligned mapping, page-locked with `cudaHostRegister` and unregistered when dropped, so what is counted is
what is held, and a drop frees. The CPU suite uses the same allocator with the registration left out
(`RegisteredAllocator(register=False)`): the page rounding is the one a GPU run meets.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from concurrent.futures import Future

import torch

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import DIRECT_ALIGN, aligned_empty, mapped_empty
from tightfit.offload.runtime.futures import all_done
from tightfit.utils.sizes import format_size

Sizes = dict[str, tuple[int, torch.dtype]]
"""A job's buffer set: buffer name -> (numel, dtype)."""


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
    `register(ptr, nbytes)` / `unregister(ptr)` default to the CUDA runtime's (tests pass recording stand-ins);
    `register=False`: the same mappings and rounding without page-locking (the CPU suite's GPU-shaped device)."""

    pinned = True

    def __init__(self, register=None, unregister=None) -> None:
        super().__init__()
        if register is False:
            register, unregister = (lambda ptr, nbytes: None), (lambda ptr: None)
            self.pinned = False
        self._register = register or _cuda_host_register
        self._unregister = unregister or _cuda_host_unregister

    @staticmethod
    def pages(numel: int, dtype: torch.dtype) -> int:
        return -(-numel * dtype.itemsize // DIRECT_ALIGN) * DIRECT_ALIGN

    def allocate(self, numel, dtype):
        nbytes = self.pages(numel, dtype)
        buf = mapped_empty(numel, dtype)  # its own mapping: no page is shared with another registration
        self._register(buf.data_ptr(), nbytes)
        self.held += nbytes
        return buf, nbytes

    def cost(self, numel, dtype):
        return self.pages(numel, dtype)

    def release(self, buf):
        self._unregister(buf.data_ptr())
        nbytes = self.pages(buf.numel(), buf.dtype)
        self.held -= nbytes
        return nbytes


def _cuda_host_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} B failed (error {int(err)})")


def _cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class EngineStall(RuntimeError):
    """A reservation waited past the pool's limit ([Note: no unbounded wait]): an engine bug, not a budget."""


def wait_limit_from_env() -> float:
    return float(os.environ.get("TIGHTFIT_WAIT_LIMIT_S", "600"))


class Grant:
    """The buffers one job was granted at once ([Note: jobs and grants]); `grant["master"]` is one of them.

    A buffer leaves the grant only back to the pool (`give`, `release`) or to another grant (`move`), never loose.
    `speculative`: counted against the speculative bound ([Note: speculative holdings])."""

    __slots__ = ("job", "pool", "bufs", "speculative", "since", "__weakref__")

    def __init__(self, pool: "HostPool", job: str, bufs: dict[str, torch.Tensor], speculative: bool) -> None:
        self.job = job
        self.pool = pool
        self.bufs = bufs
        self.speculative = speculative
        self.since = time.monotonic()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.bufs[name]

    def __contains__(self, name: str) -> bool:
        return name in self.bufs

    @property
    def nbytes(self) -> int:
        return sum(self.pool.allocator.size_of(b) for b in self.bufs.values())

    def give(self, name: str, after: Future | list[Future] | None = None) -> None:
        """Return buffer `name` to the pool, now or once `after` (the transfers touching it) are done."""
        self.pool._give(self, name, after)

    def release(self, after: Future | list[Future] | None = None) -> None:
        """Return every buffer still in the grant, now or once `after` are done."""
        for name in list(self.bufs):
            self.give(name, after)

    def move(self, name: str, to: "Grant", as_name: str | None = None) -> torch.Tensor:
        """Hand buffer `name` over to grant `to` (under `as_name`); returns it."""
        return self.pool._move(self, name, to, as_name or name)

    def rename(self, old: str, new: str) -> None:
        """Call buffer `old` `new` (a pack that becomes the gradients it holds)."""
        with self.pool._cond:
            assert new not in self.bufs, f"{self}: already holds {new!r}"
            self.bufs[new] = self.bufs.pop(old)

    def split(self) -> dict[str, "Grant"]:
        """One grant per buffer, of the same job and kind; this grant is left empty."""
        return self.pool._split(self, list(self.bufs))

    def part(self, name: str) -> "Grant":
        """Buffer `name` as a grant of its own (same job and kind)."""
        return self.pool._split(self, [name])[name]

    def speculate(self) -> bool:
        """Firm -> speculative, if the speculative bound admits it now; else False and nothing changes."""
        return self.pool._set_speculative(self, True)

    def __repr__(self) -> str:
        kind = "speculative " if self.speculative else ""
        return f"{kind}grant of {self.job!r} ({format_size(self.nbytes)})"


def _as_list(after) -> list[Future]:
    if after is None:
        return []
    return [after] if isinstance(after, Future) else [f for f in after if f is not None]


class HostPool:
    """Reusable 1-D host buffers (4096-byte aligned for O_DIRECT), at most `capacity` bytes held by the allocator,
    granted per job ([Note: jobs and grants]). `largest_job`: bytes of the largest buffer set any job of the engine
    asks for (set by the engine; the speculative bound is `capacity - largest_job`).

    poison: fill every buffer with NaN (0xFF bytes) when it is granted and when it comes back, so a read of bytes a
    transfer has not written yet, or of a buffer after it was returned, shows up as NaNs in the results (the strict
    test mode, movers.py). `guard(buf)`, when set, is asked before a returned buffer becomes reusable: it raises if
    a transfer still touches it.
    """

    def __init__(self, capacity: int | None, allocator: HostAllocator | None = None, poison: bool = False,
                 wait_limit_s: float | None = None) -> None:
        self.capacity = capacity
        self.largest_job = 0
        self.allocator = allocator or HostAllocator()
        self.poison = poison
        self.guard = None
        self.wait_limit_s = wait_limit_from_env() if wait_limit_s is None else wait_limit_s
        # (numel, dtype) -> idle buffers. Kept for reuse; released only to make room for another size.
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        # Granted buffers, weakly (one that dies without coming back is a metering leak, `live_bytes`), and the
        # grants holding any (the holders an `EngineStall` names).
        self._lent: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._grants: dict[int, Grant] = {}
        self._cond = threading.Condition()
        self._queue: list[int] = []  # tickets of waiting reservations, first come first served
        self._tickets = itertools.count()
        self.bytes = 0  # bytes the allocator holds for this pool (idle + granted), [Note: metering what ...]
        self.peak = 0
        self.speculative_bytes = 0  # held by speculative grants ([Note: speculative holdings])
        self.waits = 0  # reservations that had to wait

    @property
    def pin(self) -> bool:
        return self.allocator.pinned

    def cost(self, sizes: Sizes) -> int:
        """Bytes a buffer set takes from the pool (the allocator's rounding included)."""
        return sum(self.allocator.cost(n, d) for n, d in sizes.values())

    # ---- granting ------------------------------------------------------------------------------------------------

    def reserve(self, job: str, sizes: Sizes, adopt: list[Grant] = ()) -> Grant:
        """Grant `job` its whole buffer set, waiting (first come, first served) until the pool has room for all of it.

        adopt: speculative grants the job takes over; they stay counted as speculative while it waits and become
        part of the new, firm grant once it is granted. The caller holds no other grant while it waits."""
        self._check_fits(job, sizes)
        with self._cond:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            t0, counted = time.monotonic(), False
            try:
                while True:
                    bufs = self._allocate(sizes) if self._queue[0] == ticket and self._room_for(sizes) else None
                    if bufs is not None:
                        break
                    waited = time.monotonic() - t0
                    if waited >= self.wait_limit_s:
                        raise EngineStall(self._stall_message(job, sizes, waited))
                    if not counted:
                        self.waits, counted = self.waits + 1, True
                    self._cond.wait(timeout=self.wait_limit_s - waited)
                grant = Grant(self, job, dict(bufs), speculative=False)
                self._track(grant)
                for other in adopt:
                    for name in list(other.bufs):
                        self._move_locked(other, name, grant, name)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
        self._poison_all(bufs.values())  # the new buffers only: adopted ones hold values
        return grant

    def try_reserve(self, job: str, sizes: Sizes, speculative: bool = False) -> Grant | None:
        """Grant `job` its buffer set if the pool has room now and no reservation waits; else None (no wait).
        speculative: also within the speculative bound ([Note: speculative holdings])."""
        if self.capacity is not None and self.cost(sizes) > self.capacity:
            return None
        with self._cond:
            if self._queue or not self._room_for(sizes):
                return None
            if speculative and not self._speculation_admits(self.cost(sizes)):
                return None
            bufs = self._allocate(sizes)
            if bufs is None:
                return None
            grant = Grant(self, job, bufs, speculative)
            self._track(grant)
        self._poison_all(bufs.values())
        return grant

    def _check_fits(self, job: str, sizes: Sizes) -> None:
        need = self.cost(sizes)
        if self.capacity is not None and need > self.capacity:
            raise UsageError(f"host budget: {job} needs {format_size(need)} of staging at once and the budget leaves "
                             f"{format_size(self.capacity)} for staging; raise --cpu-mem or use smaller units")

    def _speculation_admits(self, nbytes: int) -> bool:
        if self.capacity is None:
            return True
        return self.speculative_bytes + nbytes <= self.capacity - self.largest_job

    def _room_for(self, sizes: Sizes) -> bool:
        """Could `_allocate(sizes)` run now (idle buffers of the exact size reused, others released for room)?"""
        if self.capacity is None:
            return True
        _, new, spare = self._plan(sizes)
        return self.bytes - sum(self.allocator.size_of(b) for b in spare) + new <= self.capacity

    def _plan(self, sizes: Sizes, spare: bool = True) -> tuple[dict[str, torch.Tensor], int, list[torch.Tensor]]:
        """(idle buffers reused by name, bytes of the new ones, the idle buffers that could be released if `spare`)."""
        taken: dict[tuple[int, torch.dtype], int] = {}
        reuse, new = {}, 0
        for name, key in sizes.items():
            idle = self._free.get(key, ())
            k = taken.get(key, 0)
            if k < len(idle):
                reuse[name] = idle[len(idle) - 1 - k]
                taken[key] = k + 1
            else:
                new += self.allocator.cost(*key)
        if not spare:
            return reuse, new, []
        rest = [b for key, lst in self._free.items() for b in lst[:len(lst) - taken.get(key, 0)]]
        return reuse, new, rest

    def _allocate(self, sizes: Sizes) -> dict[str, torch.Tensor] | None:
        """Grant the buffers of `sizes` now, releasing idle buffers of other sizes for room; None when even that
        leaves too little (some buffer is granted, and its return will make room). A pool that cannot make room
        with nothing granted never will: a UsageError."""
        bounded = self.capacity is not None
        reuse, new, spare = self._plan(sizes, spare=bounded)
        if bounded and self.bytes + new > self.capacity:
            spare.sort(key=self.allocator.size_of, reverse=True)  # the smallest go first
            while self.bytes + new > self.capacity and spare:
                victim = spare.pop()
                self._unidle(victim)
                self.bytes -= self.allocator.release(victim)
            if self.bytes + new > self.capacity:
                if not self._lent:
                    raise UsageError(f"host budget: {format_size(self.bytes)} held by the staging allocator and none "
                                     f"of it granted, yet no room for {format_size(new)} more; raise --cpu-mem")
                return None
        bufs: dict[str, torch.Tensor] = {}
        for name, key in sizes.items():
            if name in reuse:
                self._unidle(reuse[name])
                bufs[name] = reuse[name]
            else:
                buf, held = self.allocator.allocate(*key)
                self.bytes += held
                self.peak = max(self.peak, self.bytes)
                bufs[name] = buf
        for buf in bufs.values():
            self._lent[id(buf)] = buf
        return bufs

    def _unidle(self, buf: torch.Tensor) -> None:
        idle = self._free[(buf.numel(), buf.dtype)]
        # By identity (`==` on tensors compares values), from the end: the buffer taken is usually the last.
        del idle[next(i for i in range(len(idle) - 1, -1, -1) if idle[i] is buf)]

    def _track(self, grant: Grant) -> None:
        self._grants[id(grant)] = grant
        if grant.speculative:
            self.speculative_bytes += grant.nbytes

    # ---- giving back ----------------------------------------------------------------------------------------------

    def _give(self, grant: Grant, name: str, after) -> None:
        with self._cond:
            buf = grant.bufs.pop(name)
            if grant.speculative:
                self.speculative_bytes -= self.allocator.size_of(buf)
            if not grant.bufs:
                self._grants.pop(id(grant), None)
        last = all_done(_as_list(after))
        if last is None:
            self._return(buf)
            return
        # Returned once the last transfer touching it is done. The callback holds the buffer only until then: a
        # Future keeps its callbacks as long as it lives.
        box = [buf]
        last.add_done_callback(lambda _f: self._return(box.pop()))

    def _return(self, buf: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard(buf)
        if self.poison:
            _poison(buf)
        with self._cond:
            self._lent.pop(id(buf), None)
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)
            self._cond.notify_all()

    def _move(self, src: Grant, name: str, dst: Grant, as_name: str) -> torch.Tensor:
        with self._cond:
            buf = self._move_locked(src, name, dst, as_name)
            self._cond.notify_all()  # the speculative bytes may have dropped
        return buf

    def _move_locked(self, src: Grant, name: str, dst: Grant, as_name: str) -> torch.Tensor:
        assert as_name not in dst.bufs, f"{dst}: already holds {as_name!r}"
        buf = src.bufs.pop(name)
        nbytes = self.allocator.size_of(buf)
        self.speculative_bytes += nbytes * (int(dst.speculative) - int(src.speculative))
        dst.bufs[as_name] = buf
        if not src.bufs:
            self._grants.pop(id(src), None)
        self._grants[id(dst)] = dst
        return buf

    def _split(self, grant: Grant, names: list[str]) -> dict[str, Grant]:
        with self._cond:
            out = {}
            for name in names:
                part = Grant(self, grant.job, {}, grant.speculative)
                self._move_locked(grant, name, part, name)
                out[name] = part
            return out

    def _set_speculative(self, grant: Grant, speculative: bool) -> bool:
        with self._cond:
            if grant.speculative == speculative:
                return True
            nbytes = grant.nbytes
            if speculative and (self._queue or not self._speculation_admits(nbytes)):
                return False
            grant.speculative = speculative
            self.speculative_bytes += nbytes if speculative else -nbytes
            self._cond.notify_all()
            return True

    # ---- reports --------------------------------------------------------------------------------------------------

    def holders(self) -> list[Grant]:
        with self._cond:
            return [g for g in self._grants.values() if g.bufs]

    def _stall_message(self, job: str, sizes: Sizes, waited: float) -> str:
        held = sorted(self._grants.values(), key=lambda g: -g.nbytes)
        now = time.monotonic()
        who = "; ".join(f"{g} for {now - g.since:.0f} s" for g in held[:8]) or "nothing"
        return (f"{job} waited {waited:.0f} s for {format_size(self.cost(sizes))} of host staging "
                f"({', '.join(sizes)}); the pool holds {format_size(self.bytes)} of {format_size(self.capacity)}, "
                f"{len(self._queue) - 1} other reservation(s) queued; held by: {who}")

    def room(self) -> int | None:
        """Bytes a reservation could get now without waiting (idle buffers count: they can be released)."""
        if self.capacity is None:
            return None
        with self._cond:
            idle = sum(self.allocator.size_of(b) for lst in self._free.values() for b in lst)
            return self.capacity - self.bytes + idle

    def idle_buffers(self) -> list[torch.Tensor]:
        """The idle buffers (still the pool's), viewed as bytes. For measurements that must move bytes through
        the very memory the engine uses (the NVMe benchmark's raw reference); only while nothing reserves from the
        pool, e.g. between training steps."""
        with self._cond:
            return [b.view(-1).view(torch.uint8) for lst in self._free.values() for b in lst]

    def live_bytes(self) -> int:
        """Bytes of the buffers that exist now, idle or granted, as the allocator counts them. Equal to `bytes`
        unless a granted buffer died without coming back (then the pool meters memory that is gone)."""
        with self._cond:
            bufs = [b for lst in self._free.values() for b in lst] + list(self._lent.values())
        return sum(self.allocator.size_of(b) for b in bufs)

    def clear(self) -> None:
        """Drop the idle buffers (granted ones are their grants' until given back)."""
        with self._cond:
            for lst in self._free.values():
                for buf in lst:
                    self.bytes -= self.allocator.release(buf)
            self._free.clear()

    def _poison_all(self, bufs) -> None:
        if self.poison:
            for buf in bufs:
                _poison(buf)


def _poison(buf: torch.Tensor) -> None:
    buf.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
