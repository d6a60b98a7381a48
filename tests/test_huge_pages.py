"""`tightfit train` asks torch's CPU allocator for transparent huge pages ([Note: first touch], utils/huge_pages.py)."""

import os
import subprocess
import sys

import pytest

PROBE = """
import os, resource, sys
from tightfit.cli import main
try:
    main(["--version"])  # the CLI's entry, before anything has imported torch
except SystemExit:
    pass
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)  # the first touch of 64 MiB
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    value, faults = out.stdout.strip().splitlines()[-1].split()
    return value, int(faults)


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def test_cli_enables_huge_pages_unless_the_user_chose():
    on, faults_on = _run(None)
    off, faults_off = _run("0")
    assert on == "1" and off == "0"
    small_pages = (64 << 20) // 4096
    assert faults_off >= small_pages * 0.9  # one fault per 4 KiB page
    if _thp_mode() == "never":
        pytest.skip("the kernel's THP mode is never: the advice is inert here (the setting itself is asserted above)")
    assert faults_on < small_pages / 4  # a fault per 2 MiB page, plus the unaligned ends


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
