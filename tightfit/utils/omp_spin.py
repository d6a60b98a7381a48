"""A short idle spin for OpenMP's threads, set before torch loads its OpenMP runtime.

[Note: OpenMP's idle spin] After each parallel region a thread's OpenMP workers spin, waiting for the next one, for
up to GOMP_SPINCOUNT iterations (libgomp's default: 300,000, about a millisecond) before they sleep. Where the
engine's threads share the cores with the compute (a CPU device), the pool of the thread that ran forward and
backward keeps a core busy spinning in the gap before the next forward, and the step thread, woken to step the
first unit that forward needs, gets no core until the forward blocks waiting for that step: the whole step exposed,
however early it was queued. Measured on the 2-core VM (benchmarks/RESULTS.md batch AN): the clipped root's step of
a 4-layer model on the host tier started within 0.15 ms of `opt.step()` in three steps of four, but in the fourth
only once the forward waited for it; `optimizer_exposed_s` was 29-36% of `optimizer_s`, and 2-9% with a spin of
10,000 (the default run's speed within the VM's spread either way; OMP_WAIT_POLICY=PASSIVE, no spin at all, made
the steps 7-12% slower).

libgomp reads its environment once, when it is loaded, so `tightfit` sets this first thing, before anything
imports torch; its ranks under torchrun inherit it. A user's GOMP_SPINCOUNT or OMP_WAIT_POLICY is kept. In a user's
own loop (`tightfit.wrap`) on a CPU, `export GOMP_SPINCOUNT=10000` before starting Python does the same.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 10_000


def shorten_omp_spin(count: int = SPIN_COUNT) -> bool:
    """Set GOMP_SPINCOUNT to `count` unless torch is loaded already or the user chose a spin or wait policy;
    whether it did."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(count)
    return True
