"""Transparent huge pages for the flat buffers a fetch re-allocates: their first write at memcpy speed.

[Note: first touch] Offloading re-creates a streamed unit's flat compute buffer at every fetch (step/unit.py).
Above glibc's mmap threshold (32 MiB at most) each is a fresh mapping, and its first write faults once per 4 KiB
page: measured on the 2-core CI VM, a copy into fresh memory ran at about a third of the speed of the same copy
into touched memory (110 MB: 74 ms against 22 ms, 28,161 faults). Advised `MADV_HUGEPAGE` before that first write,
the same copy faults 567 times and runs within 20% of the touched one. The advice covers only these buffers, which
are written whole: asking torch's allocator for huge pages everywhere (`THP_MEM_ALLOC_ENABLE=1`) would also cover
autograd's gradients, but it raised the default run's peak RSS by 40 MiB (8%) through partly used huge pages in
the heap, so tightfit leaves that variable to the user; set to 1 it makes this advice redundant, set to 0 it
turns it off.
Where the kernel's THP mode is `never` or `always`, the advice is skipped.
"""

from __future__ import annotations

import os
import sys

ENV = "THP_MEM_ALLOC_ENABLE"
_MADV_HUGEPAGE = 14
_ADVISE_MIN = 32 << 20  # glibc serves this and more from a fresh mmap of its own, so the advice touches no heap
_libc = None


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


_ADVISABLE = sys.platform.startswith("linux") and _thp_mode() == "madvise"


def advise(t) -> None:
    """Advise huge pages for a CPU tensor's storage about to be written whole for the first time (a fetched flat
    buffer, [Note: first touch]), unless THP_MEM_ALLOC_ENABLE chooses. Page-aligned interior only; a no-op below
    32 MiB, off Linux, or unless the kernel's mode is `madvise`."""
    global _libc
    if not _ADVISABLE or os.environ.get(ENV) is not None or t.device.type != "cpu":  # "1": torch does it; "0": no
        return
    nbytes = t.untyped_storage().nbytes()
    if nbytes < _ADVISE_MIN:
        return
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = 4096
    start = t.untyped_storage().data_ptr()
    first = (start + page - 1) // page * page
    last = (start + nbytes) // page * page
    if last > first:
        _libc.madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: a failure changes nothing but speed
