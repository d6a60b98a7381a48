"""Host buffers whose address is a multiple of the disk's direct-I/O alignment.

Why: O_DIRECT transfers go straight between the disk and user memory, skipping the page cache (no second copy, no
cache pollution, no write-back storm), but the kernel accepts them only when the buffer address, the file offset
and the length are all multiples of the logical block size. `torch.empty` promises 64-byte alignment at best, so a
staging buffer the NVMe tier should move with O_DIRECT is allocated here: a slightly larger byte tensor, sliced at
the first aligned address. The slice is an ordinary tensor; it keeps the larger allocation alive and frees it with
itself.

4096 is used everywhere: it is the page size and a multiple of every logical block size in use (512, 4096), so a
buffer aligned to it suits any disk.

[Note: huge pages for disk buffers] A transfer's speed depends on how physically scattered its buffer is, not only
on the disk. The kernel hands a disk one segment per physically contiguous run of the buffer, a virtio disk takes
at most a few hundred segments per request (254 on the benchmark VM) and its host handles each one: 4 MiB of
scattered 4 KiB pages is 1024 segments, split over several requests. On the benchmark VM, the same mixed
read/write volume took 1.05-3.5 s through ordinary pages (how fast depended on how fragmented memory was when the
buffer was allocated, stable for a buffer and different for the next) and 0.66-0.85 s through transparent huge
pages, whatever the buffer's size. So host buffers of 2 MiB or more are their own anonymous mapping, 2 MiB-aligned,
with `madvise(MADV_HUGEPAGE)` on their whole 2 MiB blocks (the tail stays in small pages, so resident memory is the
buffer's size, not rounded up). Where the kernel has transparent huge pages off, or no huge page is free, the
advice is ignored and the buffer is ordinary memory. The mapping is freed with the last tensor viewing it.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

DIRECT_ALIGN = 4096
"""Alignment (bytes) of buffer addresses, file offsets and lengths for O_DIRECT transfers."""

HUGE_PAGE = 2 << 20
"""Size of a transparent huge page on x86-64 and most arm64 kernels; buffers this large get huge pages."""

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def aligned_empty(
    numel: int, dtype: torch.dtype = torch.uint8, *, pin: bool = False, alignment: int = DIRECT_ALIGN
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements whose first byte sits at a multiple of `alignment`.

    pin: allocate page-locked memory (only when CUDA is available; page-locked memory is what lets a host-to-device
    copy run asynchronously on a stream). Without CUDA the flag is ignored, since there is nothing to pin for.
    Unpinned buffers of HUGE_PAGE bytes or more are backed by huge pages where the kernel allows
    ([Note: huge pages for disk buffers]). The returned tensor is a view into a byte allocation up to `alignment`
    (or HUGE_PAGE) bytes larger; freeing the view frees it.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two, got {alignment}")
    itemsize = dtype.itemsize
    nbytes = numel * itemsize
    pin = pin and torch.cuda.is_available()
    if not pin and _MADV_HUGEPAGE is not None and nbytes >= HUGE_PAGE and HUGE_PAGE % alignment == 0:
        return _huge_page_backed(nbytes).view(dtype)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes].view(dtype)


def _huge_page_backed(nbytes: int) -> torch.Tensor:
    """`nbytes` of a fresh anonymous mapping, starting at a HUGE_PAGE boundary, its whole huge pages advised."""
    # Private and anonymous (Python's default for fd -1 is a shared mapping, which is shmem: no huge pages there).
    # Untouched pages cost nothing.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # holds the mapping until the last view is freed
    shift = (-raw.data_ptr()) % HUGE_PAGE
    body = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        area.madvise(_MADV_HUGEPAGE, shift, body)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages
        pass
    return raw[shift : shift + nbytes]


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy), for `os.preadv`/`os.pwrite`.

    Made with ctypes rather than numpy: a storage once shared with numpy can never be resized again, and the engine
    resizes parameter storages (step/unit.py). The view does not own the memory: the caller keeps `t` alive while
    the view is in use."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def is_aligned(t: torch.Tensor, alignment: int = DIRECT_ALIGN) -> bool:
    """True when `t`'s first byte sits at a multiple of `alignment` (what O_DIRECT needs of a buffer)."""
    return t.data_ptr() % alignment == 0


def mapped_empty(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor in its own anonymous mapping of whole pages (huge pages advised from
    HUGE_PAGE bytes up): no page is shared with any other buffer, which `cudaHostRegister` needs (a page can be
    registered once), and unmapping it really returns the memory."""
    nbytes = numel * dtype.itemsize
    pages = max(DIRECT_ALIGN, -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)
    if _MADV_HUGEPAGE is not None and nbytes >= HUGE_PAGE:
        raw = _huge_page_backed(pages)
    else:
        area = mmap.mmap(-1, pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(area, dtype=torch.uint8)
    return raw[:nbytes].view(dtype)
