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
