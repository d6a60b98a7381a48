"""The NVMe tier's request order and priorities: what lets the engine issue write-backs without waiting for them.

DiskStore promises that requests on one entry take effect in issue order; IoQueue serves urgent transfers first;
and a finished request keeps no reference to the caller's tensor (so memory its owner freed is really freed).
"""

import gc
import threading
import weakref

import torch

from tightfit.offload.runtime.aligned import aligned_empty
from tightfit.offload.tiers.nvme.io_queue import FETCH, LOAD, WRITE, IoQueue
from tightfit.offload.tiers.stores import DiskStore

N = 1 << 20  # 4 MiB of float32: several chunks per request, so requests really overlap


def _filled(value: float) -> torch.Tensor:
    return aligned_empty(N, torch.float32).fill_(value)


def test_load_issued_after_save_reads_the_saved_bytes(tmp_path):
    store = DiskStore(str(tmp_path), threads=4, chunk_bytes=1 << 16)
    store.allocate("u", {"params": (N, torch.float32)})
    try:
        for round_ in range(5):
            src = _filled(float(round_ + 1))
            dst = _filled(-1.0)
            save = store.save("u", "params", src)
            load = store.load("u", "params", dst, urgent=True)  # issued while the save is in flight
            load.result()
            assert save.done()
            assert torch.equal(dst, src), f"round {round_}: the load overtook the save"
    finally:
        store.close()


def test_saves_of_one_entry_land_in_issue_order_and_loads_before_a_save_see_the_old_bytes(tmp_path):
    store = DiskStore(str(tmp_path), threads=4, chunk_bytes=1 << 16)
    store.allocate("u", {"m": (N, torch.float32)})
    try:
        store.save("u", "m", _filled(1.0)).result()
        old = _filled(0.0)
        reads = store.load("u", "m", old)  # in flight when the saves below are issued
        saves = [store.save("u", "m", _filled(float(v))) for v in (2.0, 3.0, 4.0)]
        final = _filled(0.0)
        store.load("u", "m", final).result()
        reads.result()
        assert all(s.done() for s in saves)
        assert torch.equal(old, _filled(1.0)), "a save overtook a load issued before it"
        assert torch.equal(final, _filled(4.0)), "saves of one entry landed out of order"
    finally:
        store.close()


def test_requests_on_different_entries_do_not_wait_for_each_other(tmp_path):
    store = DiskStore(str(tmp_path), threads=2, chunk_bytes=1 << 16)
    store.allocate("u", {"a": (N, torch.float32), "b": (N, torch.float32)})
    try:
        store.save("u", "a", _filled(1.0))
        out = _filled(0.0)
        store.load("u", "b", out).result()  # b was never written: zeros, without waiting for a's save
        assert torch.equal(out, torch.zeros(N))
        store.wait()
    finally:
        store.close()


def test_a_finished_request_keeps_no_reference_to_its_tensor(tmp_path):
    store = DiskStore(str(tmp_path), threads=2)
    store.allocate("u", {"params": (N, torch.float32)})
    try:
        src = _filled(5.0)
        ref = weakref.ref(src)
        fut = store.save("u", "params", src)
        fut.result()
        del src
        gc.collect()
        assert ref() is None, "the store still holds the tensor of a finished save"
        assert fut.result() is None
    finally:
        store.close()


def test_io_queue_serves_the_most_urgent_class_first_and_fifo_within_a_class():
    q = IoQueue(1, "test-io")
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []
    done = threading.Semaphore(0)

    def record(name: str) -> None:
        order.append(name)

    def finished(error):
        assert error is None
        done.release()

    try:
        q.submit(WRITE, lambda: (started.set(), gate.wait()), (), finished)  # occupies the only worker
        assert started.wait(10)
        for name, prio in (("w1", WRITE), ("l1", LOAD), ("w2", WRITE), ("f1", FETCH), ("l2", LOAD), ("f2", FETCH)):
            q.submit(prio, record, (name,), finished)
        assert q.waiting() == [2, 2, 2]
        gate.set()
        for _ in range(7):
            assert done.acquire(timeout=10)
        assert order == ["f1", "f2", "l1", "l2", "w1", "w2"]
    finally:
        gate.set()
        q.shutdown()


def test_io_queue_reports_errors_to_the_callback():
    q = IoQueue(2, "test-io")
    got: list = []
    ev = threading.Event()

    def boom() -> None:
        raise OSError(5, "disk says no")

    def finished(error):
        got.append(error)
        ev.set()

    try:
        q.submit(LOAD, boom, (), finished)
        assert ev.wait(10)
        assert isinstance(got[0], OSError)
    finally:
        q.shutdown()
