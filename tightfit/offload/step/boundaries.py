"""A unit-major pass's boundary activations in host memory, brought back for the backward that needs them.

[Note: boundaries on the host] In unit-major order (step/unit_major.py) every micro-batch's forward is done before
any backward, so the device holds, for each unit, the input of each of the M micro-batches until that unit's
backward: with every block recomputed (checkpointed), that input is all a block keeps, and M of them per block is
what limits the tokens a step can take (Llama-2-7B under 24 GiB: 32 micro-batches of 4096 tokens hold 32 GiB of
block inputs). Where the plan says so, each block input leaves the device as it is saved for backward and comes
back, one or two ahead, for the backward of its segment:
- Which tensors: autograd's saved tensors, through `torch.autograd.graph.saved_tensors_hooks` installed on each
  micro-batch's thread for its forward. A saved tensor that *is* a boundary the executor cut (the checkpoint saves
  the unit's input; a norm at the top of an unrecomputed unit saves it too) is copied to a page-locked host buffer
  of its own (`pack`, one per segment and micro-batch, kept for the next steps) and the device keeps no reference;
  every other saved tensor stays where it is (returned unchanged: the hooks cost nothing for it).
- Freed when: nothing else holds the storage. The executor's cut holds no boundary (unit_major.py, `_Cut`: the
  gradient goes into a holder, and the tensor it came from is held as its autograd edge), the model's own forward
  frame lets go of a unit's input when the unit returns, and the copy holds its source until it has read it (the
  mover's contract: the CPU mover's closure, CUDA's `record_stream`). The device then holds a boundary from the
  moment a unit makes it until the next unit has computed it: at most one unit's M outputs and the inputs left to
  compute, `M + 1` boundaries, besides the backward's window.
- Back: `prefetch` starts the copy into a new device tensor for the segment the backward computes after the current
  one (the executor asks one segment ahead, in its order: micro-batch by micro-batch within a unit, units from the
  last); `unpack` waits for it (on CUDA the compute stream waits on its event, the host does not) or makes it now.
  A boundary saved twice is one copy; unpacked twice, one tensor; it is dropped when the executor says the segment's
  backward is done (`done`).
- Exact: the bytes come back as they left, and the backward computes with them as it would with the originals.

Memory: the host buffers are the plan's (`Prediction` host peak, "boundaries"), page-locked as the pool's are (the
pool's allocator, outside its bound: they live across the whole forward and backward, not per job). The link
carries each boundary down once and up once a step, overlapping the compute (planner/costs.py).
"""

from __future__ import annotations

import threading

import torch

from tightfit.offload.runtime.host_memory import HostAllocator


class _Saved:
    """One boundary's host copy: its shape and dtype, the copy off the device, and (in backward) its device copy."""

    __slots__ = ("slot", "shape", "dtype", "down", "up", "tensor", "used")

    def __init__(self, slot: tuple[int, int], shape: torch.Size, dtype: torch.dtype, down) -> None:
        self.slot = slot
        self.shape = shape
        self.dtype = dtype
        self.down = down  # Transfer: device -> host buffer
        self.up = None  # Transfer: host buffer -> `tensor`, once prefetched
        self.tensor: torch.Tensor | None = None
        self.used = False  # unpacked: the compute was ordered after the copy up


class BoundaryStore:
    """The host copies of one unit-major pass's boundaries, keyed by (cut, micro-batch): cut c is the input of the
    c-th unit a micro-batch meets. Collaborators: the engine's mover (copies both ways) and the pool's allocator
    (page-locked host buffers)."""

    def __init__(self, mover, allocator: HostAllocator, device: torch.device) -> None:
        self.mover = mover
        self.allocator = allocator
        self.device = device
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # kept from step to step, reused when they fit
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._lock = threading.Lock()  # packs come from the micro-batch threads, one at a time, but not the caller's
        self.bytes = 0  # host bytes held by the buffers
        self.moved = {"down": 0, "up": 0}  # bytes since the store was built (the engine's counters)

    # ---- forward: the saved-tensor pack hook, on a micro-batch's thread -------------------------------------------

    def pack(self, tensor: torch.Tensor, slot: tuple[int, int]):
        """`tensor` (a boundary, saved for backward) leaves the device for its slot's host buffer; returns the handle
        the saved tensor holds instead. A slot saved again gets the same handle."""
        with self._lock:
            saved = self._saved.get(slot)
            if saved is not None:
                return saved
            buf = self._buffer(slot, tensor.numel(), tensor.dtype)
        flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().view(-1)
        down = self.mover.pack_grads([((0, flat.shape), flat)], buf)  # the copy holds `flat` until it has read it
        saved = _Saved(slot, tensor.shape, tensor.dtype, down)
        with self._lock:
            self._saved[slot] = saved
            self.moved["down"] += tensor.numel() * tensor.element_size()
        return saved

    def _buffer(self, slot: tuple[int, int], numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is not None and buf.dtype == dtype and buf.numel() == numel:
            return buf
        if buf is not None:
            self.bytes -= self.allocator.release(buf)
        buf, nbytes = self.allocator.allocate(numel, dtype)
        self.bytes += nbytes
        self._buffers[slot] = buf
        return buf

    # ---- backward: the executor's prefetch, the unpack hook, the end of a segment --------------------------------

    def prefetch(self, slot: tuple[int, int]) -> None:
        """Start bringing the slot's boundary back to the device (nothing if it was never packed, or is back)."""
        saved = self._saved.get(slot)
        if saved is not None:
            self._bring(saved)

    def _bring(self, saved: _Saved) -> None:
        if saved.up is not None:
            return
        saved.down.done.result()  # made in forward: long done, but the host buffer must be whole before it goes up
        dst = torch.empty(saved.shape, dtype=saved.dtype, device=self.device)
        saved.up = self.mover.copy_in(self._buffers[saved.slot][:dst.numel()].view(saved.shape), dst)
        saved.tensor = dst
        self.moved["up"] += dst.numel() * dst.element_size()

    def unpack(self, saved: _Saved) -> torch.Tensor:
        """The boundary on the device, as autograd asks for it in backward."""
        self._bring(saved)
        self.mover.wait(saved.up)
        saved.used = True
        return saved.tensor

    def done(self, slot: tuple[int, int]) -> None:
        """The slot's segment has had its backward: its device copy goes (the host buffer stays for the next step)."""
        with self._lock:
            saved = self._saved.pop(slot, None)
        if saved is not None and saved.up is not None and not saved.used:
            self.mover.cancel(saved.up)  # brought back for nothing: the copy must not outlive its destination

    def clear(self) -> None:
        """The pass ended (or failed): every handle goes."""
        for slot in list(self._saved):
            self.done(slot)

    def device_held(self) -> int:
        """Boundaries now back on the device (the backward's window)."""
        return sum(1 for s in self._saved.values() if s.tensor is not None)

    def close(self) -> None:
        """Give the host buffers back. Their copies are done: every pass ends with `clear`."""
        self.clear()
        for buf in self._buffers.values():
            self.bytes -= self.allocator.release(buf)
        self._buffers.clear()
