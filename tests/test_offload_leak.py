"""Regression: training steps of a wrapped model must not accumulate autograd graph objects.

A backward hook whose closure held the autograd nodes it was stored on formed a cycle through C++ that Python's
garbage collector cannot break; each step leaked part of its graph (~1.3 MB RSS per step on the default GPT).
"""

from __future__ import annotations

import gc
import time

import torch

import tightfit
from tightfit import Placement
from tightfit.models.gpt import GPT, GPTConfig


def _graph_objects() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__.endswith("Backward0"))


def test_steps_leave_no_graph_behind(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    placement = Placement.everywhere("nvme", nvme_dir=str(tmp_path)).with_units(
        root=tightfit.UnitPlacement())  # a mixed placement: root on the device, blocks on NVMe
    tightfit.wrap(model, placement)
    opt = tightfit.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
        model(x, torch.roll(x, -1, 1)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for i in range(3):
        step(i)
    before = _graph_objects()
    for i in range(20):
        step(i)
    assert _graph_objects() == before


def test_a_fetched_staging_buffer_is_freed_when_the_pool_drops_it(tmp_path):
    """A disk fetch's staging buffer, once given back and dropped by the pool, is freed at once: no callback of a
    finished read holds it (a reference cycle through the read future's callbacks once kept it, unmetered, until
    the cyclic collector ran; 13-27 MiB with 14 MB units, benchmarks/RESULTS.md batch H)."""
    import weakref

    from tightfit.offload.runtime.movers import CpuMover
    from tightfit.offload.runtime.host_memory import HostPool
    from tightfit.offload.tiers.stores import DiskStore

    store = DiskStore(str(tmp_path), threads=2)
    store.allocate("u", {"params": (1 << 16, torch.float32)})
    store.save("u", "params", torch.arange(1 << 16, dtype=torch.float32)).result()
    pool, dst = HostPool(None), torch.empty(1 << 16)
    mover = CpuMover(pool)
    gc.disable()
    try:
        grant = pool.reserve("fetch u", {"params": (1 << 16, torch.float32)})
        freed = weakref.ref(grant["params"])
        t = mover.fetch(store, "u", "params", dst, staging=grant["params"])
        grant.release(after=t.done)
        del grant
        mover.wait(t)
        del t
        assert torch.equal(dst, torch.arange(1 << 16, dtype=torch.float32))
        for _ in range(200):  # `done` wakes the waiter before its callbacks (the return) have run
            if pool.idle_buffers():
                break
            time.sleep(0.005)
        (staging,) = pool.idle_buffers()
        del staging
        pool.clear()
        # The disk and copy threads drop their frames' references as they return, just after the transfer is done
        # (on a loaded machine, a few milliseconds after); a cycle would hold it for good, the collector being off.
        for _ in range(200):
            if freed() is None:
                break
            time.sleep(0.005)
        assert freed() is None, "a dropped staging buffer is still allocated"
    finally:
        gc.enable()
        mover.close()
        store.close()
