"""Tier stores: where a unit's state buffers live between uses. One interface, three implementations.

Why: the engine never asks "is this on NVMe?". It holds one store object per tier and, per unit and state, the
store the placement picked; all it does with a store is `allocate`, `tensor` (the stored tensor itself when the
tier is addressable memory), `load` (stored -> a buffer of the caller's) and `save` (a buffer -> stored).
Adding a tier is adding a class here.

- `MemoryStore(Tier.DEVICE)`: tensors in device memory (CUDA, or the CPU when there is no GPU).
- `MemoryStore(Tier.HOST)`: tensors in host memory, page-locked on CUDA machines so copies to and from the GPU
  can run asynchronously on a stream.
- `DiskStore`: one safetensors file per unit ("<unit>.safetensors") in the swap folder, read and written at known offsets by
  `tightfit.offload.nvme.NvmeStore` from its thread pool. Nothing is addressable; every use is a `load`.

Entries are named by (unit, entry), entry one of "params", "master", "grads", "exp_avg", "exp_avg_sq".
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tightfit.errors import UsageError
from tightfit.offload.placement import Tier


def done_future(value=None) -> Future:
    """A future that is already complete (what a synchronous copy returns)."""
    f: Future = Future()
    f.set_result(value)
    return f


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


class TierStore:
    """The interface. `bytes` is what the store holds now; the engine's meter adds it to its tier's total."""

    tier: Tier
    bytes: int = 0

    def allocate(self, unit: str, entries: dict[str, tuple[int, torch.dtype]]) -> None:
        raise NotImplementedError

    def tensor(self, unit: str, entry: str) -> torch.Tensor | None:
        """The stored tensor itself (1-D), or None when the tier is not addressable memory."""
        return None

    def load(self, unit: str, entry: str, dst: torch.Tensor) -> Future:
        raise NotImplementedError

    def save(self, unit: str, entry: str, src: torch.Tensor) -> Future:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryStore(TierStore):
    """Flat tensors in device or host memory. Loads and saves are plain (synchronous) copies."""

    def __init__(self, tier: Tier, device: torch.device, pin: bool = False) -> None:
        self.tier = tier
        self.device = device
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        # (unit, entry) -> 1-D tensor. Lives as long as the engine (freed by `close`).
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}
        self.bytes = 0

    def allocate(self, unit, entries):
        for entry, (numel, dtype) in entries.items():
            # Zeroed so a model built on the meta device reads zeros, not garbage, before import_state.
            t = torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin)
            self._tensors[(unit, entry)] = t
            self.bytes += t.numel() * t.element_size()

    def tensor(self, unit, entry):
        return self._tensors[(unit, entry)]

    def load(self, unit, entry, dst):
        dst.copy_(self._tensors[(unit, entry)])
        return done_future()

    def save(self, unit, entry, src):
        self._tensors[(unit, entry)].copy_(src)
        return done_future()

    def close(self):
        self._tensors.clear()
        self.bytes = 0


class DiskStore(TierStore):
    """One safetensors file per unit in the swap folder, read and written by the NVMe engine."""

    tier = Tier.NVME

    def __init__(self, folder: str, budget_bytes: int | None = None, threads: int = 8,
                 chunk_bytes: int = 1 << 20) -> None:
        try:
            from tightfit.offload.nvme import NvmeStore
        except ImportError as e:  # pragma: no cover - only while the NVMe engine is missing
            raise UsageError(f"the NVMe tier is not available in this build ({e}); place no state on nvme") from None
        # 1 MiB chunks: a unit's entry is a few MB, so smaller chunks are what keeps `threads` requests in flight.
        self.nvme = NvmeStore(folder, budget_bytes=budget_bytes, threads=threads, chunk_bytes=chunk_bytes)
        self.bytes = 0  # host bytes: none; disk usage is reported by `nvme.stats()`
        self.disk_bytes = 0
        self._files: dict[str, str] = {}

    def allocate(self, unit, entries):
        file = unit  # the store adds ".safetensors"; unit names are module paths, plain file names
        self._files[unit] = file
        self.nvme.create(file, {entry: ((numel,), dtype) for entry, (numel, dtype) in entries.items()})
        self.disk_bytes += sum(_nbytes(n, d) for n, d in entries.values())

    def load(self, unit, entry, dst):
        return self.nvme.read(self._files[unit], entry, dst)

    def save(self, unit, entry, src):
        return self.nvme.write(self._files[unit], entry, src)

    def stats(self) -> dict:
        return self.nvme.stats()

    def close(self):
        self.nvme.flush()
        self.nvme.close()
