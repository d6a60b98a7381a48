"""The mover contract ([Note: the mover contract], tightfit/offload/runtime/movers.py) and the CUDA-path findings of
issue 15 that can be expressed on a CPU: the strict CPU mover completes copies late and checks the contract, so the
bugs a GPU would hit show up here.

Each regression test names its finding; each failed before its fix (see the commit that adds it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

import tightfit
from offload_helpers import batch, loss_of, one_torch_thread, tiny_gpt, train  # noqa: F401  (autouse fixture)
from tightfit import Placement, Tier
from tightfit.errors import UsageError
from tightfit.offload.step.engine import engine_of
from tightfit.offload.runtime.movers import CpuMover, MoverContractError
from tightfit.offload.step.scheduler import StepPhase
from tightfit.offload.runtime.host_memory import HostAllocator, HostPool, RegisteredAllocator
from tightfit.offload.tiers.stores import MemoryStore


def _unit_sizes():
    probe = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=1)[1]
    units = engine_of(probe).units
    sizes = units["root"].compute_bytes, units["blocks.0"].compute_bytes
    engine_of(probe).close()
    return sizes


# ---- the strict mover catches what the contract forbids ------------------------------------------------------------

class _SlowStore:
    """A tier store whose loads complete when the test says so (or fail)."""

    def __init__(self, value: torch.Tensor, error: BaseException | None = None) -> None:
        self.value, self.error, self.gate = value, error, threading.Event()

    def tensor(self, unit, entry):
        return None  # not addressable: a fetch goes through a staging buffer

    def load(self, unit, entry, dst, urgent=False) -> Future:
        fut: Future = Future()

        def finish() -> None:
            self.gate.wait()
            if self.error is not None:
                fut.set_exception(self.error)
            else:
                dst.copy_(self.value)
                fut.set_result(None)

        threading.Thread(target=finish, daemon=True).start()
        return fut


def test_strict_mover_fails_a_copy_into_a_buffer_freed_while_it_was_pending():
    pool = HostPool(None)
    mover = CpuMover(pool, strict=True, max_delay_s=0.0)
    store = _SlowStore(torch.arange(1024, dtype=torch.float32))
    dst = torch.empty(1024)
    t = mover.fetch(store, "u", "params", dst, staging=torch.empty(1024))
    dst.untyped_storage().resize_(0)  # freed without wait() or cancel(): the bug of finding 1
    store.gate.set()
    with pytest.raises(MoverContractError, match="freed or resized"):
        mover.wait(t)
    with pytest.raises(MoverContractError):
        mover.close()


def test_strict_mover_fails_a_pool_buffer_given_back_while_a_copy_reads_it():
    pool = HostPool(None)
    mover = CpuMover(pool, strict=True, max_delay_s=0.05)
    grads = [((0, torch.Size([256])), torch.ones(256))]
    grant = pool.reserve("ship", {"pack": (256, torch.float32)})
    t = mover.pack_grads(grads, grant["pack"])
    with pytest.raises(MoverContractError, match="given back while a pending copy"):
        grant.give("pack")
    t.done.exception()  # let the copy finish before the mover goes
    mover.violations.clear()
    mover.close()


@pytest.mark.parametrize("cancelled", [False, True], ids=["copied", "cancelled"])
def test_a_finished_copy_holds_no_tensor_when_it_says_done(cancelled):
    """Found by the unit-major boundary test on the 2-core CI machine: a block input the caller had let go of was still
    alive after its copy to the host was done, because the copy thread's job still held it until the thread looked
    up. The engine frees device memory by letting go (as CUDA's `record_stream` frees a block once its stream's work
    is done), so `done` must mean the copy holds nothing. Deterministic here: the copy thread sets `done` while the
    test's callback runs on it, before the thread is back in its pool."""
    pool = HostPool(None)
    mover = CpuMover(pool, threads=1)
    gate = threading.Event()
    mover.copier.submit(gate.wait)  # the copy queues behind this, so the callback is added before it runs
    source = torch.ones(256)
    ref = source.untyped_storage()._weak_ref()
    t = mover.pack_grads([((0, source.shape), source)], torch.empty(256))
    del source
    if cancelled:
        mover.cancel(t)
    seen = []
    t.done.add_done_callback(lambda _: seen.append(torch.UntypedStorage._expired(ref)))
    gate.set()
    t.done.result()
    mover.close()
    assert seen == [True]


def test_strict_pool_poisons_what_it_lends_and_takes_back():
    pool = HostPool(None, poison=True)
    grant = pool.reserve("job", {"buf": (8, torch.float32)})
    buf = grant["buf"]
    assert torch.isnan(buf).all(), "a granted buffer reads as NaN until something writes it"
    buf.fill_(1.0)
    view = buf[:4]
    grant.give("buf")
    assert torch.isnan(view).all(), "a buffer given back reads as NaN through any view kept by mistake"


# ---- finding 1: evicting a unit whose fetch is in flight -------------------------------------------------------

def test_evicting_a_unit_whose_fetch_is_in_flight_cancels_the_copy(tmp_path):
    """Finding 1. Under a device budget of 2 root units + 4 blocks, prefetch depth 2, every state on NVMe and the
    step during backward, materialising a unit evicts idle prefetched units, some with their fetch still in
    flight. Releasing such a unit used to hand the fetch's result (on CUDA an Event) to the pool and free the buffer
    the copy was still writing; the contract cancels the copy, or orders the free after it."""
    root, block = _unit_sizes()
    budget = 2 * root + 4 * block
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), device_budget=budget,
                                     prefetch_depth=2)
    losses, model, _ = train(tiny_gpt, placement, steps=4, early=True)
    assert losses == train(tiny_gpt, steps=4)[0]
    engine = engine_of(model)
    assert engine.mover.strict, "the suite runs the strict mover (tests/conftest.py)"
    stats = engine.mover.stats
    assert stats["cancelled"] + stats["cancel_waits"] > 0, "no fetch in flight was evicted: the scenario is gone"
    assert not engine.mover.violations
    assert engine.device_peak <= budget
    engine.close()


# ---- finding 2: a failed disk read --------------------------------------------------------------------------------

def test_a_failed_read_returns_its_staging_buffer_and_raises_at_wait():
    """Finding 2. The read's error reaches whoever waits for the fetch, and its staging buffer goes back to the
    pool (it used to stay lent forever): the transfer's `done` completes on failure too, and the grant gives the
    buffer back after it."""
    pool = HostPool(1 << 20)
    mover = CpuMover(pool, strict=True)
    store = _SlowStore(torch.zeros(1024), error=OSError(5, "Input/output error"))
    grant = pool.reserve("fetch u", {"params": (1024, torch.float32)})
    t = mover.fetch(store, "u", "params", torch.empty(1024), staging=grant["params"])
    grant.release(after=t.done)
    store.gate.set()
    with pytest.raises(OSError, match="Input/output"):
        mover.wait(t)
    for _ in range(200):  # `done` wakes the waiter before its callbacks (the return) have run
        if pool.room() == 1 << 20:
            break
        time.sleep(0.005)
    assert not pool.holders() and pool.bytes == pool.live_bytes() == 4096
    assert pool.room() == 1 << 20, "the buffer is idle again: the whole pool can be granted"
    mover.close()


def test_a_fetch_never_waits_for_a_device_copy_in_forward(tmp_path):
    """Finding 2's other half, as a counter: in steady state, forward never makes the host wait for a device copy to
    complete (it waits for disk reads and orders compute after copies), and the pool meters exactly the buffers
    that exist."""
    losses, model, _ = train(tiny_gpt, Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap")), steps=4,
                             early=True)
    engine = engine_of(model)
    assert engine.host_waits[StepPhase.FORWARD] == 0
    assert engine.pool.bytes == engine.pool.live_bytes() == engine.pool.allocator.held
    engine.close()


# ---- finding 3: pinned memory metered as the allocator holds it --------------------------------------------------

class PowerOfTwoCaching(HostAllocator):
    """Stands for torch's pinned caching host allocator: every request rounded up to a power of two, nothing ever
    given back (a released block stays cached, and serves a later request of its size)."""

    def __init__(self) -> None:
        super().__init__()
        self.cached: dict[int, int] = {}
        self.blocks: dict[int, int] = {}  # id(buffer) -> block size

    @staticmethod
    def _block(numel, dtype) -> int:
        n = max(1, numel * dtype.itemsize)
        return 1 << (n - 1).bit_length()

    def cost(self, numel, dtype):
        return 0 if self.cached.get(self._block(numel, dtype)) else self._block(numel, dtype)

    def size_of(self, buf):
        return self.blocks[id(buf)]

    def allocate(self, numel, dtype):
        block, held = self._block(numel, dtype), self.cost(numel, dtype)
        if not held:
            self.cached[block] -= 1
        buf = torch.empty(numel, dtype=dtype)
        self.blocks[id(buf)] = block
        self.held += held
        return buf, held

    def release(self, buf):
        block = self.blocks.pop(id(buf))
        self.cached[block] = self.cached.get(block, 0) + 1
        return 0


def test_pool_meters_what_a_rounding_caching_allocator_holds():
    """Finding 3. The pool counts the bytes its allocator holds (rounded, never given back), not the bytes it asked
    for: it used to count 3000 B for a 4096 B block and subtract what a drop did not free."""
    alloc = PowerOfTwoCaching()
    pool = HostPool(128 << 10, allocator=alloc)
    sizes = [3000, 5000, 3000, 20000, 700, 20000, 9000]
    lent = []
    for i, n in enumerate(sizes):
        lent.append(pool.reserve(f"job {i}", {"buf": (n // 4, torch.float32)}))
        if i % 2:
            lent.pop(0).release()
        assert pool.bytes == alloc.held, (i, pool.bytes, alloc.held)
    for grant in lent:
        grant.release()
    assert pool.bytes == alloc.held == 4096 + 8192 + 32768 + 1024 + 32768 + 16384
    # Dropping idle buffers to make room frees nothing with such an allocator: said at once, not waited for.
    with pytest.raises(UsageError, match="none of it granted"):
        pool.reserve("big", {"buf": (40000 // 4, torch.float32)})
    assert pool.bytes == alloc.held <= 128 << 10


def test_registered_allocator_pins_exact_pages_and_unpins_on_drop():
    """Finding 3, the CUDA pool's allocator: each buffer its own mapping, registered once for its whole pages and
    unregistered when the pool drops it (torch's pinned allocator never gave memory back)."""
    registered: dict[int, int] = {}

    def register(ptr, nbytes):
        assert ptr % 4096 == 0 and ptr not in registered
        registered[ptr] = nbytes

    alloc = RegisteredAllocator(register=register, unregister=registered.pop)
    pool = HostPool(1 << 20, allocator=alloc)
    ab = pool.reserve("two", {"a": (1000, torch.float32), "b": (3000, torch.bfloat16)})
    assert sorted(registered.values()) == [4096, 8192] and pool.bytes == alloc.held == 12288
    ab.release()
    big = pool.reserve("big", {"x": (260_000, torch.float32)})  # 254 pages: room once the idle 4 KiB one is dropped
    assert sorted(registered.values()) == [8192, 254 * 4096] and pool.bytes == alloc.held == 8192 + 254 * 4096
    big.release()
    pool.clear()
    assert not registered and pool.bytes == alloc.held == 0


def test_host_tier_pins_only_what_a_gpu_copies_from_or_into():
    """Finding 3: masters and moments of the host tier never take part in an asynchronous device copy, so only the
    compute params (uploaded) and the gradients (their first micro-batch lands there: [Note: gradients land
    converted]) are page-locked."""
    registered: dict[int, int] = {}
    alloc = RegisteredAllocator(register=registered.__setitem__, unregister=registered.pop)
    store = MemoryStore(Tier.HOST, torch.device("cpu"), pinned=alloc)
    store.allocate("u", {"params": (1000, torch.bfloat16), "master": (1000, torch.float32),
                         "grads": (1000, torch.float32), "exp_avg": (1000, torch.float32)})
    assert list(registered.values()) == [4096, 4096]
    assert store.bytes == 2 * 4096 + 2 * 4000
    assert store.copy_target("u", "grads") is not None and store.copy_target("u", "master") is None
    store.close()
    assert not registered


def test_host_gradients_stay_pageable_where_the_system_locks_no_more():
    """A refused page-locking of the gradients leaves them pageable (they come through packs: no copy target);
    the compute params, which every fetch uploads, still need it and say so."""
    registered: dict[int, int] = {}

    def register(ptr: int, nbytes: int) -> None:
        if registered:
            raise RuntimeError(f"cudaHostRegister of {nbytes} B failed (error 2)")
        registered[ptr] = nbytes

    alloc = RegisteredAllocator(register=register, unregister=registered.pop)
    store = MemoryStore(Tier.HOST, torch.device("cpu"), pinned=alloc)
    store.allocate("u", {"params": (1000, torch.bfloat16), "grads": (1000, torch.float32)})
    assert store.copy_target("u", "params") is not None and store.copy_target("u", "grads") is None
    assert store.bytes == 4096 + 4000 and list(registered.values()) == [4096]
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        store.allocate("v", {"params": (1000, torch.bfloat16)})
    store.close()
    assert not registered


# ---- finding 4: what gradients cost on their way off the device ----------------------------------------------------

def test_bf16_gradients_move_four_bytes_then_two_per_parameter(tmp_path):
    """Finding 4, revisited by [Note: gradients land converted]. A step's first gradients leave the device as fp32
    (converted on the device a bounded chunk at a time, a temporary the plan counts) and are the sum itself: 4 bytes
    a parameter over the link and no host pass. A later micro-batch's are added on the host to that sum: they move
    the bf16 bytes and the host upcasts them."""
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path)),
                          compute_dtype=torch.bfloat16)
    engine = engine_of(model)
    trainable = sum(u.spec.train_numel for u in engine.units.values())
    autograd = sum(u.grad_bytes for u in engine.units.values())
    for micro, total in ((0, 4 * trainable), (1, 6 * trainable)):
        loss_of(model, *batch(micro)).backward()
        engine.wait_grads()
        assert engine.mover.stats["bytes_to_host"] == total, micro
    assert autograd == 2 * trainable
    engine.close()


def test_bf16_offloaded_training_still_tracks_fp32():
    ref = train(tiny_gpt, steps=5)[0]
    bf16 = train(tiny_gpt, Placement.everywhere(Tier.HOST), steps=5, compute_dtype=torch.bfloat16)[0]
    assert max(abs(a - b) / b for a, b in zip(bf16, ref)) < 2e-2


# ---- finding 6: autocast over fp32 compute weights ----------------------------------------------------------------

def _saved_bytes(model, x, y, shapes) -> int:
    """Bytes autograd saved for backward in bf16 tensors shaped like a Linear's weight: the casts autocast makes."""
    total = [0]

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model, x, y).backward()
    return total[0]


def test_autocast_over_fp32_weights_is_refused_under_a_device_budget(tmp_path):
    """Finding 6. autocast(bf16) over fp32 compute weights saves a bf16 cast of every weight for backward (measured
    here with a saved-tensors byte count on a plain model): memory outside the engine's meter. Under a device
    budget the engine refuses it with what to do instead; without one it warns."""
    x, y = batch(0)
    plain = tiny_gpt()
    linears = [m.weight for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    shapes = {tuple(w.shape) for w in linears}
    assert _saved_bytes(plain, x, y, shapes) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _saved_bytes(plain, x, y, shapes) >= 2 * sum(w.numel() for w in linears)

    budgeted = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.HOST, device_budget=64 << 20))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UsageError, match="compute_dtype=torch.bfloat16"):
        loss_of(budgeted, x, y)
    engine_of(budgeted).close()
    unbudgeted = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.HOST))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="autocast"):
        loss_of(unbudgeted, x, y)
    engine_of(unbudgeted).close()


# ---- finding 9: backward hooks on another thread -------------------------------------------------------------------

def test_backward_on_another_thread_gives_the_same_losses(tmp_path):
    """Finding 9. On CUDA, autograd runs backward hooks on its device thread, not the thread that ran forward; here
    backward runs on a second thread, with every state on NVMe, the step during backward and late copies."""
    torch.manual_seed(0)
    ref = train(tiny_gpt, steps=3)[0]
    torch.manual_seed(0)
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path)))
    opt = tightfit.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(3):
        loss = loss_of(model, *batch(step))
        opt.step_during_backward()
        errors = []

        def run(loss=loss):
            try:
                torch.set_num_threads(1)
                loss.backward()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        th = threading.Thread(target=run, name="autograd-device-thread")
        th.start()
        th.join()
        assert not errors, errors
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == ref
    engine_of(model).close()


# ---- a tier copy that crosses devices runs off the caller's thread ------------------------------------------------

def test_cross_device_store_copies_run_on_the_copier():
    """Finding 7. A store load or save between two memories (on CUDA: the device tier and a host buffer) is handed
    to the mover's copy thread and returns a future; within one memory it is a plain copy."""
    calls = []

    def copier(dst, src, into_device=False):
        calls.append((dst.device, src.device, into_device))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    store = MemoryStore(Tier.DEVICE, torch.device("cpu"), copier=copier)
    store.allocate("u", {"master": (8, torch.float32)})
    store.save("u", "master", torch.ones(8)).result()
    assert calls == [] and torch.equal(store.tensor("u", "master"), torch.ones(8)), "same memory: a plain copy"
    store.load("u", "master", torch.empty(8, device="meta")).result()
    assert calls == [(torch.device("meta"), torch.device("cpu"), False)]
    store.save("u", "master", torch.empty(8, device="meta"))
    assert calls[-1] == (torch.device("cpu"), torch.device("meta"), True), "a save into device memory says so"


def test_copies_into_device_memory_come_before_what_follows_them():
    """[Note: device writes in stream order]: on a GPU the compute stream waits on a copy into device memory when
    it is issued. The CPU mover's copy into device memory, started 50 ms late, is seen by a copy out issued after
    it (which waits for it) and by the compute after `order_compute`."""
    pool = HostPool(1 << 20)
    mover = CpuMover(pool, strict=True, max_delay_s=0.05, seed=3)
    device, host = torch.zeros(1 << 16), torch.ones(1 << 16)
    write = mover.copy_async(device, host, into_device=True)
    out = torch.empty(1 << 16)
    read = mover.copy_async(out, device)
    read.result()
    assert write.done() and torch.equal(out, host), "the copy out read the written values"
    again = mover.copy_async(device, host * 2, into_device=True)
    mover.order_compute()
    assert again.done() and torch.equal(device, host * 2)
    mover.close()


def test_refreshing_resident_params_needs_no_staging_on_one_memory(monkeypatch):
    """bf16 params on the device tier, fp32 master and moments on the host tier of a CPU machine: the step casts the
    new master into the device copy in place; a host budget with nothing left for staging (what the planner gives
    such a placement) must do (a staging buffer for the cast once made it fail)."""
    from tightfit import UnitPlacement
    from tightfit.offload.step.budget_checks import host_tier_bytes

    unit = UnitPlacement(params=Tier.DEVICE, master=Tier.HOST, grads=Tier.HOST, optim=Tier.HOST)
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "shared")  # the CPU's own path: the device copy is host memory
    probe = tightfit.wrap(tiny_gpt(), Placement(default=unit), compute_dtype=torch.bfloat16)
    host = host_tier_bytes(engine_of(probe).units)
    engine_of(probe).close()
    losses = train(tiny_gpt, Placement(default=unit, host_budget=host), steps=3, compute_dtype=torch.bfloat16)[0]
    assert losses == train(tiny_gpt, Placement(default=unit), steps=3, compute_dtype=torch.bfloat16)[0]


def test_copies_run_on_one_core():
    """[Note: one core per copy]: a copy runs beside the compute, whose intra-op threads take every core; the copy
    threads run their copies with one intra-op thread (torch's default would oversubscribe the cores)."""
    mover = CpuMover(HostPool(None))
    seen = mover.copier.submit(torch.get_num_threads).result()
    mover.close()
    assert seen == 1
