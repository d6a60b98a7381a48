"""Tier stores: where a unit's state buffers live between uses. One interface, three implementations.

Why: the engine never asks "is this on NVMe?". It holds one store object per tier and, per unit and state, the
store the placement picked; all it does with a store is `allocate`, `tensor` (the stored tensor itself when the
tier is addressable memory), `load` (stored -> a buffer of the caller's) and `save` (a buffer -> stored).
Adding a tier is adding a class here.

- `MemoryStore(Tier.DEVICE)`: tensors in device memory (CUDA, or the CPU when there is no GPU).
- `MemoryStore(Tier.HOST)`: tensors in host memory; on CUDA machines the compute params are page-locked, so
  their copies to the GPU run asynchronously on a stream.
- `DiskStore`: one safetensors file per unit ("<unit>.safetensors") in the swap folder, read and written at known
  offsets by `tiers.nvme.store.NvmeStore` from its thread pool. Nothing is addressable; every use is a `load`.

Entries are named by (unit, entry), entry one of "params", "master", "grads", "exp_avg", "exp_avg_sq".
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from tightfit.errors import UsageError
from tightfit.offload.memory_model import PINNED_ENTRIES
from tightfit.offload.placement import Tier
from tightfit.offload.runtime.futures import done_future
from tightfit.offload.tiers.nvme.io_queue import FETCH, LOAD, WRITE


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


class TierStore:
    """The interface. `bytes` is what the store holds now; the engine's meter adds it to its tier's total."""

    tier: Tier
    bytes: int = 0

    def allocate(self, unit: str, entries: dict[str, tuple[int, torch.dtype]], lock: tuple[str, ...] = ()) -> None:
        """Room for the unit's `entries`; `lock`: those a GPU copies into or out of asynchronously (page-locked
        where the store's memory can be)."""
        raise NotImplementedError

    def tensor(self, unit: str, entry: str) -> torch.Tensor | None:
        """The stored tensor itself (1-D), or None when the tier is not addressable memory."""
        return None

    def copy_target(self, unit: str, entry: str) -> torch.Tensor | None:
        """The stored tensor when a device copy may write it asynchronously, else None."""
        return None

    def load(self, unit: str, entry: str, dst: torch.Tensor, urgent: bool = False, *,
             start: int | None = None) -> Future:
        """Copy the stored entry into `dst`. urgent: compute is about to wait for it (a parameter fetch); a tier
        with a request queue serves it before other requests. start: copy only the entry's elements
        [start, start + dst.numel()) (None: all of it, `dst` has its size)."""
        raise NotImplementedError

    def save(self, unit: str, entry: str, src: torch.Tensor, *, start: int | None = None) -> Future:
        """Copy `src` into the stored entry, or into its elements [start, start + src.numel()) when `start` is
        given: a range leaves the rest of the entry as it is (e.g. the frozen tail of a unit's params)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryStore(TierStore):
    """Flat tensors in device or host memory.

    pinned: an allocator of page-locked memory (staging.RegisteredAllocator) for the entries a GPU copies from or
    into asynchronously (`memory_model.PINNED_ENTRIES`, unless a unit names its own: `OffloadUnit.locked`): the
    host tier's compute params (uploaded by every fetch) and gradients (the first micro-batch's land there straight
    from the device: [Note: gradients land converted], step/gradients.py).
    Masters and moments never take part in such a copy and stay pageable ([Note: metering what the allocator
    holds], runtime/host_memory.py).
    copier: `fn(dst, src) -> Future` running a copy off the caller's thread; used for loads and saves that cross
    memories (the device tier of a GPU to or from a host buffer), so no hook or step waits for such a copy inline.
    Copies within one memory are plain synchronous copies. remote: this store's memory is apart from the host's
    even on a CPU (device_kind.py): every copy goes through the copier, as on a GPU.
    """

    def __init__(self, tier: Tier, device: torch.device, pinned=None, copier=None, remote: bool = False) -> None:
        self.tier = tier
        self.device = device
        self.pinned = pinned if device.type == "cpu" else None
        self.copier = copier
        self.remote = remote  # every copy in or out crosses memories (device memory apart from the host's)
        # (unit, entry) -> 1-D tensor. Lives as long as the engine (freed by `close`).
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}
        self._locked: set[tuple[str, str]] = set()  # the entries `pinned` allocated (released by `close`)
        self.bytes = 0

    def allocate(self, unit, entries, lock=PINNED_ENTRIES):
        for entry, (numel, dtype) in entries.items():
            t = None
            if self.pinned is not None and entry in lock:
                try:
                    t, held = self.pinned.allocate(numel, dtype)
                    self._locked.add((unit, entry))
                except RuntimeError:
                    if entry == "params":
                        raise
                    # A system that page-locks no more: the gradients stay pageable and come through packs, as a
                    # later micro-batch's do (`copy_target` None); a master is uploaded from pageable memory (the
                    # driver stages it: the copy no longer overlaps the host).
            if t is None:
                t, held = torch.empty(numel, dtype=dtype, device=self.device), numel * dtype.itemsize
            # Zeroed so a model built on the meta device reads zeros, not garbage, before import_state.
            t.zero_()
            self._tensors[(unit, entry)] = t
            self.bytes += held

    def tensor(self, unit, entry):
        return self._tensors[(unit, entry)]

    def copy_target(self, unit, entry):
        """Page-locked on a GPU (its stand-in on the CPU suite's GPU-shaped device): the mover copies into it."""
        return self._tensors[(unit, entry)] if (unit, entry) in self._locked else None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, into_store: bool) -> Future:
        if self.copier is not None and (self.remote or dst.device != src.device):
            # A save into device memory is ordered before what follows it ([Note: device writes in stream order]).
            return self.copier(dst, src, into_device=into_store and self.tier == Tier.DEVICE)
        dst.copy_(src)
        return done_future()

    def _stored(self, unit: str, entry: str, start: int | None, numel: int) -> torch.Tensor:
        t = self._tensors[(unit, entry)]
        return t if start is None else t[start:start + numel]

    def load(self, unit, entry, dst, urgent=False, *, start=None):
        return self._copy(dst, self._stored(unit, entry, start, dst.numel()), into_store=False)

    def save(self, unit, entry, src, *, start=None):
        return self._copy(self._stored(unit, entry, start, src.numel()), src, into_store=True)

    def close(self):
        for key in self._locked:
            self.pinned.release(self._tensors[key])
        self._locked.clear()
        self._tensors.clear()
        self.bytes = 0


class DiskStore(TierStore):
    """One safetensors file per unit in the swap folder, read and written by the NVMe engine.

    [Note: entry order] Requests on one entry take effect in the order they were issued: a load issued while a save
    of the same entry is in flight waits for it (and reads the new bytes), a save waits for the loads and the save
    before it. Loads of an entry run concurrently with each other, and requests on different entries never wait
    for each other. This is what lets the engine issue write-backs and move on: the next use of the entry is
    ordered after them by the store, not by the caller waiting.
    """

    tier = Tier.NVME

    def __init__(self, folder: str, budget_bytes: int | None = None, threads: int | None = None,
                 chunk_bytes: int | None = None) -> None:
        try:
            from tightfit.offload.tiers.nvme.store import NvmeStore
        except ImportError as e:  # pragma: no cover - only while the NVMe engine is missing
            raise UsageError(f"the NVMe tier is not available in this build ({e}); place no state on nvme") from None
        from tightfit.offload.tiers.nvme.swap_folder import SwapFolder

        # The swap files live in this run's own subfolder of `folder`, under a lock on `folder` (swap_folder.py):
        # a second run there is refused, a dead run's leftovers are cleaned, nothing else in it is touched.
        self.swap = SwapFolder.claim(folder)
        # I/O threads and largest transfer: the probe's for this folder's disk unless given ([Note: disk tuning] in
        # nvme/tuning.py); a tensor goes as few transfers as that allows ([Note: transfer size], nvme/transfer.py).
        try:
            self.nvme = NvmeStore(self.swap.path, budget_bytes=budget_bytes, threads=threads, chunk_bytes=chunk_bytes)
        except BaseException:
            self.swap.release()
            raise
        self.bytes = 0  # host bytes: none; disk usage is reported by `nvme.stats()`
        self.disk_bytes = 0
        self._files: dict[str, str] = {}
        # (unit, entry) -> (loads not finished, the last save if not finished). Guarded by _lock.
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], tuple[list[Future], Future | None]] = {}
        self._waiting: set[Future] = set()  # requests held back by the entry order, not yet given to the disk

    def allocate(self, unit, entries, lock=()):
        file = unit  # the store adds ".safetensors"; unit names are module paths, plain file names
        self._files[unit] = file
        self.nvme.create(file, {entry: ((numel,), dtype) for entry, (numel, dtype) in entries.items()})
        self.disk_bytes += sum(_nbytes(n, d) for n, d in entries.values())

    def load(self, unit, entry, dst, urgent=False, *, start=None):
        return self._ordered("read", unit, entry, dst, FETCH if urgent else LOAD, start)

    def drop(self, unit: str) -> None:
        """Remove `unit`'s swap file once its requests are done: the run's last checkpoint has its states ([Note: the
        last save takes the swap's place] in memory_model.py). A later request for the unit fails."""
        file = self._files.pop(unit, None)
        if file is not None:
            self.nvme.delete(file)

    def save(self, unit, entry, src, *, start=None):
        return self._ordered("write", unit, entry, src, WRITE, start)

    def wait(self) -> None:
        """Block until every load and save issued so far is done (errors stay on their futures)."""
        while True:
            with self._lock:
                pending = list(self._waiting)
            if not pending:
                break
            wait_futures(pending)
        self.nvme.wait()

    def _ordered(self, kind: str, unit: str, entry: str, t: torch.Tensor, priority: int,
                 start: int | None) -> Future:
        """Issue the request now, or once the requests on the same entry it must follow are done (a range of an
        entry is ordered as the whole entry: [Note: entry order])."""
        key = (unit, entry)
        file = self._files[unit]
        with self._lock:
            loads, save = self._inflight.get(key, ([], None))
            loads = [f for f in loads if not f.done()]
            save = save if save is not None and not save.done() else None
            before = ([save] if save is not None else []) + (loads if kind == "write" else [])
            if not before:
                fut = self._issue(kind, file, entry, t, priority, start)
            else:
                fut = Future()
                self._waiting.add(fut)
                fut.set_running_or_notify_cancel()
            if kind == "read":
                self._inflight[key] = (loads + [fut], save)
            else:
                self._inflight[key] = ([], fut)
        fut.add_done_callback(lambda f: self._forget(key, f))
        if before:
            remaining = [len(before)]
            box = [t]  # emptied at issue: the earlier requests keep this callback as long as they live

            def one_done(_: Future) -> None:
                with self._lock:
                    remaining[0] -= 1
                    if remaining[0]:
                        return
                try:
                    self._issue(kind, file, entry, box.pop(), priority, start).add_done_callback(
                        lambda f: _forward(f, fut))
                except BaseException as e:  # e.g. the store was closed meanwhile
                    fut.set_exception(e)
                with self._lock:
                    self._waiting.discard(fut)

            for f in before:
                f.add_done_callback(one_done)
        return fut

    def _forget(self, key: tuple[str, str], fut: Future) -> None:
        """Drop a finished request from the entry's bookkeeping (nothing here may keep its tensor alive)."""
        with self._lock:
            loads, save = self._inflight.get(key, ([], None))
            loads = [f for f in loads if f is not fut]
            save = None if save is fut else save
            if loads or save is not None:
                self._inflight[key] = (loads, save)
            else:
                self._inflight.pop(key, None)

    def _issue(self, kind: str, file: str, entry: str, t: torch.Tensor, priority: int, start: int | None) -> Future:
        return (self.nvme.read(file, entry, t, priority, start=start) if kind == "read"
                else self.nvme.write(file, entry, t, priority, start=start))

    def stats(self) -> dict:
        return self.nvme.stats()

    def close(self):
        """Flush and close the files, remove them and the run's subfolder, unlock the swap folder: all of it even
        when the disk failed (a run stopped by a full swap disk leaves no swap files)."""
        try:
            self.wait()
            self.nvme.flush()
        finally:
            try:
                self.nvme.close()
            finally:
                self.swap.release()


def _forward(src: Future, dst: Future) -> None:
    """Complete `dst` with `src`'s outcome."""
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
