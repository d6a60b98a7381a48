"""The host pool's grants and the unit lifecycle, on their own ([Note: jobs and grants], runtime/host_memory.py;
step/lifecycle.py): what makes the engine deadlock-free is checked here without a model."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tightfit.offload.runtime.host_memory import EngineStall, HostPool
from tightfit.offload.step.lifecycle import Event, GradsState, Lifecycle, ParamsState, Phase

F32 = torch.float32


def test_a_job_is_granted_all_of_its_buffers_or_waits_for_all():
    pool = HostPool(4000)
    held = pool.reserve("step blocks.0", {"master": (500, F32)})  # 2000 of 4000 B
    got = []

    def second() -> None:
        got.append(pool.reserve("ship grads of blocks.1", {"pack": (250, F32), "grads": (300, F32)}))  # 2200 B

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.1)
    assert not got and pool.bytes == 2000, "nothing of the set is taken while the whole does not fit"
    held.release()
    t.join(5)
    assert got and set(got[0].bufs) == {"pack", "grads"} and pool.waits == 1
    got[0].release()


def test_a_wait_past_the_limit_names_the_job_and_who_holds_the_pool():
    pool = HostPool(4000, wait_limit_s=0.2)
    holder = pool.reserve("step blocks.3", {"master": (800, F32)})
    with pytest.raises(EngineStall, match=r"fetch blocks.7 waited .* held by: grant of 'step blocks.3'"):
        pool.reserve("fetch blocks.7", {"params": (600, F32)})
    holder.release()


def test_speculation_leaves_the_largest_job_room():
    """Held-ahead grants together stay within capacity - largest job, and none is granted while a job waits: the
    firm jobs in flight then always leave the largest job its room."""
    pool = HostPool(10_000)
    pool.largest_job = 6000
    first = pool.try_reserve("preload a", {"m": (500, F32)}, speculative=True)  # 2000 B
    assert first is not None and pool.speculative_bytes == 2000
    assert pool.try_reserve("preload b", {"m": (600, F32)}, speculative=True) is None  # 2400 more: over 4000
    second = pool.try_reserve("preload c", {"m": (500, F32)}, speculative=True)
    assert second is not None and pool.speculative_bytes == 4000
    # A job that takes a preload over keeps it counted as speculative while it waits, firm once granted.
    job = pool.reserve("step a", {"grads": (1000, F32)}, adopt=[first])
    assert set(job.bufs) == {"m", "grads"} and not job.speculative and pool.speculative_bytes == 2000
    # Firm -> speculative (a pack kept as held gradients) only within the bound.
    assert not job.speculate()  # 6000 B would exceed the bound
    job.give("grads")
    assert job.speculate() and pool.speculative_bytes == 4000
    for g in (job, second):
        g.release()
    assert pool.speculative_bytes == 0 and not pool.holders()


def test_the_lifecycle_takes_events_in_order_only():
    life = Lifecycle("blocks.0", resident=False)
    for event in (Event.FETCH, Event.FETCHED, Event.FORWARD_START, Event.FORWARD_END, Event.EVICT, Event.FETCH,
                  Event.FETCHED, Event.BACKWARD_START, Event.GRADS_SHIPPED, Event.BACKWARD_END):
        life.on(event)
    assert (life.params, life.phase, life.grads) == (ParamsState.READY, Phase.IDLE, GradsState.SHIPPING)
    with pytest.raises(AssertionError, match="blocks.0: fetch in params state ready"):
        life.on(Event.FETCH)
    with pytest.raises(AssertionError, match="stepped in grads state shipping"):
        life.on(Event.STEPPED)  # a step before the gradients have landed
    life.on(Event.GRADS_SHIPPED)  # a second micro-batch's ship: two in flight, the last to land decides
    life.on(Event.GRADS_LANDED)
    assert life.grads == GradsState.SHIPPING
    life.on(Event.GRADS_HELD)
    assert life.grads == GradsState.HELD
    life.on(Event.STEPPED)
    assert life.grads == GradsState.EMPTY
    resident = Lifecycle("root", resident=True)
    resident.on(Event.EVICT)  # resident params never move
    assert resident.params == ParamsState.RESIDENT


def test_workers_run_their_kernels_on_their_thread_budget():
    """[Note: thread budget]: on a GPU machine the gradient worker and the step thread split the cores (one left for
    the launch thread); on a CPU device each runs one thread, so the thread computing forward and backward keeps the
    only OpenMP pool ([Note: one OpenMP pool]); a worker's count is its own, the caller's stays."""
    from tightfit.offload.runtime.workers import Worker, thread_budget

    assert thread_budget(16, cuda=True) == {"grads": 4, "step": 11, "alone": 15}
    assert thread_budget(2, cuda=True) == {"grads": 1, "step": 1, "alone": 1}
    assert thread_budget(16, cuda=False) == {"grads": 1, "step": 1, "alone": 1}
    before = torch.get_num_threads()
    worker = Worker("test-budget", threads=1)
    try:
        assert worker.submit(torch.get_num_threads).result() == 1
        worker.submit(worker.use_threads, 2).result()
        assert worker.submit(torch.get_num_threads).result() == 2  # and for the jobs after
        worker.submit(worker.use_threads, None).result()
        assert worker.submit(torch.get_num_threads).result() == 2
    finally:
        worker.shutdown()
    assert torch.get_num_threads() == before


def test_a_step_after_backward_takes_the_gradient_workers_cores(tmp_path, monkeypatch):
    """[Note: thread budget]: a unit stepped while gradients are still being added runs on the step thread's share;
    one stepped once backward is over and every gradient added takes the gradient worker's cores too. A 2-thread
    budget stands in for a GPU machine's; the losses stay torch's."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from offload_helpers import tiny_gpt, train
    from tightfit import Placement, Tier
    from tightfit.offload.step import engine as engine_module
    from tightfit.offload.step.optimizer import StepRunner

    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")  # a GPU's path: every step on the step thread
    monkeypatch.setattr(engine_module, "thread_budget", lambda total, cuda: {"grads": 1, "step": 1, "alone": 2})
    decided, ran = [], []
    real_done, real_step = engine_module.OffloadEngine._grads_done, StepRunner.step_one
    monkeypatch.setattr(engine_module.OffloadEngine, "_grads_done",
                        lambda self: (lambda done: (decided.append(done), done)[1])(real_done(self)))
    monkeypatch.setattr(StepRunner, "step_one",
                        lambda self, *a: (ran.append(torch.get_num_threads()), real_step(self, *a))[1])
    expected, *_ = train(tiny_gpt, steps=3, accum=2)
    ran.clear()
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=3, accum=2, early=True)
    assert losses == expected
    assert len(decided) == len(ran) > 0 and True in decided
    assert ran == [2 if done else 1 for done in decided]


@pytest.mark.parametrize("early", [True, False])
def test_the_gradient_worker_takes_every_core_but_one_when_no_step_runs_beside_it(early, monkeypatch):
    """[Note: thread budget]: in a backward whose units are stepped as their gradients land, the gradient worker keeps
    its share; in any other backward (a clipped step waits for it) it runs alone and takes every core but one. A
    2-thread budget stands in for a GPU machine's."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from offload_helpers import tiny_gpt, train
    from tightfit import Placement, Tier
    from tightfit.offload.step import engine as engine_module
    from tightfit.offload.step import gradients

    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")  # gradients leave through the worker, as on a GPU
    monkeypatch.setattr(engine_module, "thread_budget", lambda total, cuda: {"grads": 1, "step": 1, "alone": 2})
    seen = []
    real = gradients._add_into
    monkeypatch.setattr(gradients, "_add_into", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    clip = None if early else 1.0  # two micro-batches: the second's are added ([Note: gradients land converted])
    expected, *_ = train(tiny_gpt, steps=2, accum=2, clip=clip)
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=2, accum=2, early=early, clip=clip)
    assert losses == expected
    assert seen and set(seen) == {1 if early else 2}


def _set_elsewhere(n: int) -> None:
    """Another thread sets its own count (torch remembers the last one set, process-wide)."""
    t = threading.Thread(target=lambda: torch.set_num_threads(n))
    t.start()
    t.join()


def test_a_threads_own_count_holds_whatever_another_thread_sets_later():
    """[Note: a thread's own count]: torch gives a fresh thread, at its first kernel, the count some thread last set;
    a worker's and a copy thread's own count must survive that. Without asking for the count before setting it,
    each of these saw the other thread's."""
    from tightfit.offload.runtime.host_memory import HostPool
    from tightfit.offload.runtime.movers import CpuMover
    from tightfit.offload.runtime.workers import Worker

    before = torch.get_num_threads()
    one = Worker("test-own-count", threads=1)
    default = Worker("test-default-count")  # the creating thread's count
    mover = CpuMover(HostPool(None))
    try:
        for w in (one, default):
            w.submit(lambda: None).result()  # the thread exists, its count set
        mover.copier.submit(lambda: None).result()
        _set_elsewhere(2 if before == 1 else 1)
        assert one.submit(torch.get_num_threads).result() == 1
        assert default.submit(torch.get_num_threads).result() == before
        _set_elsewhere(2)
        assert mover.copier.submit(torch.get_num_threads).result() == 1  # [Note: one core per copy]
    finally:
        one.shutdown()
        default.shutdown()
        mover.close()
        torch.set_num_threads(before)
