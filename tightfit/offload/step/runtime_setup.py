"""The engine's memories and what moves bytes between them, for one device and placement: built once, at wrap.

Why apart from the engine: which allocator, mover and stores a device gets is decided by two facts (CUDA or not;
device memory apart from the host's or not) and the placement's tiers, and nothing else; the engine holds what this
builds for its lifetime and closes it.

Device memory apart from host memory (a GPU; the CPU suite's GPU-shaped CPU device): every byte between them crosses
by a copy through page-locked memory (device_kind.py). The mover ([Note: the mover contract] in runtime/movers.py)
and the pool it stages through: page-locked by `RegisteredAllocator` on CUDA (exactly metered, freed when dropped);
the same mappings, not locked, on a GPU-shaped CPU device. The strict CPU mover (copies complete late, the contract
checked) is what the test suite runs. The stores, one per tier: the device's on the compute device, the host's in
CPU memory, the disk's created only when some state is placed there; copies across the two memories run on the
mover, off the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tightfit.offload.device_kind import separate_memory
from tightfit.offload.placement import Placement, Tier
from tightfit.offload.runtime.host_memory import HostAllocator, HostPool, RegisteredAllocator
from tightfit.offload.runtime.movers import CpuMover, CudaMover, strict_seed
from tightfit.offload.tiers.stores import DiskStore, MemoryStore, TierStore


@dataclass
class Runtime:
    separate: bool
    """Device memory is apart from host memory: what the CPU may work on in place."""
    pinned: RegisteredAllocator | None
    """The host tier's allocator of what a GPU copies asynchronously (its compute params and gradients)."""
    pool: HostPool
    """Every transfer's and optimizer step's host buffers ([Note: jobs and grants]); its capacity is set once the
    host tier is known."""
    mover: CpuMover | CudaMover
    stores: dict[Tier, TierStore]


def build_runtime(placement: Placement, device: torch.device, disk, strict: bool) -> Runtime:
    """The pool, mover and stores for `device` and `placement`. `disk` (DiskTuning, from wrap): overrides of the
    disk tuning the NVMe store derives by itself. All live until the engine's `close`."""
    cuda = device.type == "cuda"
    separate = separate_memory(device.type)
    pinned = RegisteredAllocator() if cuda else RegisteredAllocator(register=False) if separate else None
    staging = RegisteredAllocator() if cuda else RegisteredAllocator(register=False) if separate else HostAllocator()
    pool = HostPool(None, allocator=staging)
    mover = CudaMover(pool, device) if cuda else CpuMover(pool, strict=strict, seed=strict_seed())
    copier = mover.copy_async
    stores: dict[Tier, TierStore] = {
        Tier.DEVICE: MemoryStore(Tier.DEVICE, device, copier=copier, remote=separate),
        Tier.HOST: MemoryStore(Tier.HOST, torch.device("cpu"), pinned=pinned, copier=copier),
    }
    if placement.uses(Tier.NVME):
        stores[Tier.NVME] = DiskStore(placement.nvme_dir, placement.nvme_budget,
                                      threads=disk.threads if disk else None,
                                      chunk_bytes=disk.chunk_bytes if disk else None)
    return Runtime(separate, pinned, pool, mover, stores)
