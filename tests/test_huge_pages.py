"""Fetched flat buffers are advised transparent huge pages ([Note: first touch], utils/huge_pages.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_a_fetched_flat_buffer_is_advised_huge_pages():
    """wrap() in a user's process (torch's allocator not asked for huge pages): a unit's flat buffer, re-allocated
    at every fetch, faults per 2 MiB page on its first write, not per 4 KiB page."""
    import resource

    import torch

    import tightfit
    from tightfit.utils import huge_pages

    if "THP_MEM_ALLOC_ENABLE" in os.environ or _thp_mode() != "madvise":
        pytest.skip("needs the kernel's THP mode `madvise` and torch's allocator without THP_MEM_ALLOC_ENABLE")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3000, 3000), torch.nn.Linear(3000, 3000))  # 36 MB units
    tightfit.wrap(model, tightfit.Placement.everywhere("host"), units=["0", "1"], device="cpu")
    x = torch.randn(1, 3000)
    with torch.no_grad():
        model(x)  # the first forward records the order
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    small_pages = 2 * 3000 * 3001 * 4 // 4096  # two fetches of a 36 MB unit, at one fault per 4 KiB
    assert faults < small_pages / 4, (faults, small_pages)
    assert huge_pages._ADVISABLE


def test_advice_goes_only_to_a_buffer_that_is_its_own_mapping():
    """[Note: advice on a mapping of its own]: a 40 MiB chunk of glibc's heap (served there once the heap has grown
    and freed that much) is not advised, or the small allocations sharing that mapping would be huge pages too;
    a chunk glibc mapped on its own is. Both through `advise`, checked in the kernel's flags for the mapping."""
    import torch

    from tightfit.utils import huge_pages

    if "THP_MEM_ALLOC_ENABLE" in os.environ or _thp_mode() != "madvise":
        pytest.skip("needs the kernel's THP mode `madvise` and torch's allocator without THP_MEM_ALLOC_ENABLE")
    from test_nvme import _vma_flags

    mib = 1 << 20
    own = torch.empty(40 * mib, dtype=torch.uint8)  # above glibc's threshold: a mapping of its own
    assert huge_pages.own_mapping(own.data_ptr())
    huge_pages.advise(own)
    assert "hg" in _vma_flags(own.data_ptr() + mib)  # its whole pages: the first holds glibc's header too
    # A heap chunk of 40 MiB, in a process of its own: glibc's threshold raised as a heap that grew and freed that
    # much has it (mallopt fixes it for the process's life).
    heap = textwrap.dedent("""
        import ctypes, sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_nvme import _vma_flags
        from tightfit.utils import huge_pages
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.mallopt(-3, 512 << 20)  # M_MMAP_THRESHOLD
        p = libc.malloc(40 << 20)
        chunk = torch.frombuffer((ctypes.c_uint8 * (40 << 20)).from_address(p), dtype=torch.uint8)
        huge_pages.advise(chunk)
        print(huge_pages.own_mapping(p), "hg" in _vma_flags(p + (1 << 20)))
    """)
    out = subprocess.run([sys.executable, "-c", heap, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
