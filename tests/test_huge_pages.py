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
    at every fetch, faults per 2 MiB page on its first write, not per 4 KiB page. In a fresh process, as a user's
    first run is: in a long one glibc may serve the buffer from its heap, which is not advised ([Note: advice on a
    mapping of its own])."""
    from tightfit.utils import huge_pages

    if "THP_MEM_ALLOC_ENABLE" in os.environ or _thp_mode() != "madvise":
        pytest.skip("needs the kernel's THP mode `madvise` and torch's allocator without THP_MEM_ALLOC_ENABLE")
    assert huge_pages._ADVISABLE
    code = textwrap.dedent("""
        import resource, torch, tightfit
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3000, 3000), torch.nn.Linear(3000, 3000))  # 36 MB units
        tightfit.wrap(model, tightfit.Placement.everywhere("host"), units=["0", "1"], device="cpu")
        x = torch.randn(1, 3000)
        with torch.no_grad():
            model(x)  # the first forward records the order
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            model(x)
            print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    faults = int(out.stdout.split()[-1])
    small_pages = 2 * 3000 * 3001 * 4 // 4096  # two fetches of a 36 MB unit, at one fault per 4 KiB
    assert faults < small_pages / 4, (faults, small_pages)


def test_advice_goes_only_to_a_buffer_that_is_its_own_mapping():
    """[Note: advice on a mapping of its own]: a 40 MiB chunk of glibc's heap (served there once the heap has grown
    and freed that much) is not advised, or the small allocations sharing that mapping would be huge pages too;
    a chunk glibc mapped on its own is. Both through `advise`, checked in the kernel's flags for the mapping, in a
    fresh process (in a long one, such as this suite's, glibc may serve even the first buffer from its heap)."""
    from tightfit.utils import huge_pages

    if "THP_MEM_ALLOC_ENABLE" in os.environ or _thp_mode() != "madvise":
        pytest.skip("needs the kernel's THP mode `madvise` and torch's allocator without THP_MEM_ALLOC_ENABLE")
    assert huge_pages._ADVISABLE
    code = textwrap.dedent("""
        import ctypes, sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_nvme import _vma_flags
        from tightfit.utils import huge_pages
        mib = 1 << 20
        own = torch.empty(40 * mib, dtype=torch.uint8)  # a fresh process: above glibc's threshold, mapped alone
        huge_pages.advise(own)
        print(huge_pages.own_mapping(own.data_ptr()), "hg" in _vma_flags(own.data_ptr() + mib))
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.mallopt(-3, 512 * mib)  # M_MMAP_THRESHOLD: as a heap that grew and freed 40 MiB has it
        p = libc.malloc(40 * mib)
        chunk = torch.frombuffer((ctypes.c_uint8 * (40 * mib)).from_address(p), dtype=torch.uint8)
        huge_pages.advise(chunk)
        print(huge_pages.own_mapping(p), "hg" in _vma_flags(p + mib))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "False", "False"]  # advised alone; the heap's chunk not
