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
