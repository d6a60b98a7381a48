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

[Note: advice on a mapping of its own] glibc serves 32 MiB and more from a fresh mmap only when its heap has no
free chunk that large: once the heap has grown and freed that much, a buffer of 32 MiB comes from the heap, and
advice on it would mark the heap's pages, which every later small allocation then shares (the suite saw a
1000-element buffer in a huge-page mapping after such a run). The mapping's bounds cannot tell (the kernel merges
adjacent anonymous mappings into one), but glibc's chunk header can: the size word just before the buffer has
IS_MMAPPED set for a chunk that is its own mapping. It is read only where the maps say the word lies in the
buffer's own mapping (and never in `[heap]`); a buffer from another allocator may be misjudged, which costs only
speed or a partly used huge page.
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
    if last > first and own_mapping(start):
        _libc.madvise(first, last - first, _MADV_HUGEPAGE)  # advice only: a failure changes nothing but speed


def own_mapping(start: int) -> bool:
    """Is the buffer at `start` (a pointer malloc returned) a glibc chunk that is a mapping of its own? ([Note:
    advice on a mapping of its own]). False where the maps cannot be read or the header is not in the mapping."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= start < hi:
                    if fields[-1] == "[heap]" or start - 16 < lo:
                        return False
                    return bool(ctypes.c_size_t.from_address(start - 8).value & 2)  # glibc's IS_MMAPPED
    except (OSError, ValueError, IndexError):
        pass
    return False
