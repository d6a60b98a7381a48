"""Transparent huge pages for large CPU tensors: first writes to fresh memory at memcpy speed.

[Note: first touch] Offloading re-creates large CPU buffers every step: a streamed unit's flat compute buffer at
each fetch (flat_unit.py) and one gradient per parameter at each backward (autograd). Above glibc's mmap threshold
(32 MiB at most) each is a fresh mapping, and its first write faults once per 4 KiB page: measured on the 2-core CI
VM, a copy into fresh memory ran at about a third of the speed of the same copy into touched memory (110 MB: 74 ms
against 22 ms, 28,161 faults). torch's CPU allocator can instead align allocations of 2 MiB and more to 2 MiB and
`madvise(MADV_HUGEPAGE)` them (`THP_MEM_ALLOC_ENABLE=1`, read once, at torch's first allocation): 567 faults for
the same copy, which then runs within 20% of the touched one. Where the kernel's THP mode is `never` the advice does
nothing and costs nothing.

The variable must be set before torch allocates anything, so only an entry point that runs before `import torch`
can set it: `tightfit train` does (cli.py); a user's own process keeps whatever it chose. An explicit value in the
environment (`THP_MEM_ALLOC_ENABLE=0`) always wins.
"""

from __future__ import annotations

import os
import sys

ENV = "THP_MEM_ALLOC_ENABLE"


def enable_before_torch() -> bool:
    """Ask torch's CPU allocator for huge pages if torch is not imported yet and the user set nothing.
    Returns whether torch will use them."""
    if "torch" not in sys.modules:
        os.environ.setdefault(ENV, "1")
    return os.environ.get(ENV) == "1"


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
    """Advise huge pages for a CPU tensor's storage about to be written for the first time (the flat buffer a fetch
    re-allocates), in a process where torch's allocator does not already (a user's own process, [Note: first
    touch]) and whose environment does not choose (`THP_MEM_ALLOC_ENABLE=0` keeps them off). Page-aligned interior
    only; a no-op below 32 MiB, off Linux, or unless the kernel's mode is `madvise`."""
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
