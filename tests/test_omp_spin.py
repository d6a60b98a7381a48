"""`tightfit` shortens OpenMP's idle spin before torch loads its runtime ([Note: OpenMP's idle spin] in
tightfit/utils/omp_spin.py), keeping a user's own setting."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, sys
from tightfit.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
import torch
print("SPIN", os.environ.get("GOMP_SPINCOUNT"), "torch loaded after:", "torch" in sys.modules)
"""


def _spin_in_child(**env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("SPIN"))
    return line.split()[1]


def test_the_command_line_sets_a_short_spin_before_torch_loads_and_keeps_the_users():
    from tightfit.utils.omp_spin import SPIN_COUNT

    assert _spin_in_child() == str(SPIN_COUNT)
    assert _spin_in_child(GOMP_SPINCOUNT="300000") == "300000"
    assert _spin_in_child(OMP_WAIT_POLICY="active") == "None"  # a wait policy of the user's: no spin of ours


def test_nothing_is_set_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded: libgomp has read its environment already

    from tightfit.utils.omp_spin import shorten_omp_spin

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert shorten_omp_spin() is False and "GOMP_SPINCOUNT" not in os.environ
