"""Host buffers whose address is a multiple of the disk's direct-I/O alignment.

Why: O_DIRECT transfers go straight between the disk and user memory, skipping the page cache (no second copy, no
cache pollution, no write-back storm), but the kernel accepts them only when the buffer address, the file offset
and the length are all multiples of the logical block size. `torch.empty` promises 64-byte alignment at best, so a
staging buffer the NVMe tier should move with O_DIRECT is allocated here: a slightly larger byte tensor, sliced at
the first aligned address. The slice is an ordinary tensor; it keeps the larger allocation alive and frees it with
itself.

4096 is used everywhere: it is the page size and a multiple of every logical block size in use (512, 4096), so a
buffer aligned to it suits any disk.
"""

from __future__ import annotations

import torch

DIRECT_ALIGN = 4096
"""Alignment (bytes) of buffer addresses, file offsets and lengths for O_DIRECT transfers."""


def aligned_empty(
    numel: int, dtype: torch.dtype = torch.uint8, *, pin: bool = False, alignment: int = DIRECT_ALIGN
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements whose first byte sits at a multiple of `alignment`.

    pin: allocate page-locked memory (only when CUDA is available; page-locked memory is what lets a host-to-device
    copy run asynchronously on a stream). Without CUDA the flag is ignored, since there is nothing to pin for.
    The returned tensor is a view into a byte allocation up to `alignment` bytes larger; freeing the view frees it.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    pin = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes].view(dtype)


def is_aligned(t: torch.Tensor, alignment: int = DIRECT_ALIGN) -> bool:
    """True when `t`'s first byte sits at a multiple of `alignment` (what O_DIRECT needs of a buffer)."""
    return t.data_ptr() % alignment == 0
