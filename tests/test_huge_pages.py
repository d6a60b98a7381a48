"""Fetched flat buffers are advised transparent huge pages ([Note: first touch], utils/huge_pages.py)."""

import os

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
