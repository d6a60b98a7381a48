"""At most two glibc malloc arenas for the process: the heap the engine's threads leave behind, bounded.

[Note: one heap for the engine's threads] glibc gives a thread that allocates beside another its own arena (up to
8 per core), and memory a thread frees goes back to its arena, not to the system, unless it was a mapping of its
own. The engine runs its forward, backward, gradient worker, step thread and disk threads side by side, each
freeing buffers of a few MiB to a few tens (below glibc's dynamic mmap threshold, which rises to 32 MiB once such a
mapping is freed), so each arena kept its high water of them: a 13 M-parameter model on NVMe in unit-major order
ran 24% over its planned RSS in one process, 34-38% on each of two ranks (benchmarks/RESULTS.md batch AL), and
within 5% with two arenas. Two, not one: the main thread and the threads beside it keep the lock of one arena
uncontended for the main thread's small allocations. The step time did not change beyond the VM's spread (batch AL).

A user who sets MALLOC_ARENA_MAX keeps their own (glibc read it at start); elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX = -8
"""mallopt's parameter number for the most arenas (malloc.h)."""
ARENAS = 2


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas at `arenas` for the arenas made from now on; whether it did."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))
