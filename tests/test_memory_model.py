"""The memory model's arithmetic against budgets computed by hand, phase by phase (as FSDP2's memory tests do).

A small model: a root unit of 1000 elements and three blocks of 400, all trainable; fp32 compute (c = 4) unless
said otherwise. Every expected figure is written out from [Note: bytes per state] and [Note: phases] in
tightfit/offload/memory_model.py, not computed by the code under test.
"""

from __future__ import annotations

from tightfit.offload import memory_model as mm
from tightfit.offload.placement import Placement, Tier, UnitPlacement

ROOT, BLOCK = 1000, 400
UNITS = [mm.UnitSize("root", ROOT, ROOT)] + [mm.UnitSize(f"blocks.{i}", BLOCK, BLOCK) for i in range(3)]
ALL = ROOT + 3 * BLOCK  # 2200 elements


def test_everything_on_the_device():
    p = Placement.everywhere(Tier.DEVICE, prefetch_depth=1)
    sm = mm.step_memory(UNITS, p, 4, cuda=False, act=mm.Activations(saved=500, peak=800))
    # params 4 B + master 0 (fp32 on the params' tier: one tensor) + grads 4 B + moments 8 B per element.
    states = 16 * ALL
    assert sm.phases["forward"]["device"] == {"states": states, "window": 0, "grads in flight": 0, "activations": 500}
    # Backward: autograd's grads of the root and of two blocks (compute dtype) until added to the device tier.
    assert sm.phases["backward"]["device"] == {"states": states, "window": 0,
                                               "grads in flight": 4 * ROOT + 2 * 4 * BLOCK, "activations": 800}
    assert sm.phases["step"]["device"] == {"states": states, "window": 0, "grads in flight": 0, "activations": 0}
    assert sm.peak("host") == 0 and sm.peak("nvme") == 0  # nothing staged: no pool
    assert sm.peak("device") == states + 4 * ROOT + 8 * BLOCK + 800
    assert sm.engine_device() == states + 4 * ROOT + 8 * BLOCK
    # A CPU-only machine: the device is the process's RAM, on top of its floor.
    assert mm.process_bytes(sm, cuda=False, floor=10_000) == 10_000 + sm.peak("device")
    assert mm.process_bytes(sm, cuda=True, floor=10_000) == 10_000


def test_the_root_s_last_gradient_and_the_activations_peak_are_two_moments():
    """The root ships its gradients when its last one arrived (a language model's embedding, at backward's end,
    when the activations are freed): its earlier ones (the head's) sit beside the activations' peak, all of them
    beside what is still live at the end. The engine's own count is the second moment's."""
    p = Placement.everywhere(Tier.DEVICE, prefetch_depth=1)
    states, blocks = 16 * ALL, 2 * 4 * BLOCK
    act = mm.Activations(saved=500, peak=5000, root_grads_early=4 * 300, at_root_end=40)
    sm = mm.step_memory(UNITS, p, 4, cuda=False, act=act)
    assert sm.phases["backward"]["device"] == {"states": states, "window": 0,
                                               "grads in flight": 4 * 300 + blocks, "activations": 5000}
    assert sm.phases["backward end"]["device"] == {"states": states, "window": 0,
                                                   "grads in flight": 4 * ROOT + blocks, "activations": 40}
    assert sm.peak("device") == states + 4 * 300 + blocks + 5000  # not + 4 * ROOT: the two do not coincide
    assert sm.engine_device() == states + 4 * ROOT + blocks
    # Small activations: the end of backward is the peak.
    small = mm.step_memory(UNITS, p, 4, cuda=False, act=mm.Activations(500, 600, 4 * 300, 40))
    assert small.peak("device") == states + 4 * ROOT + blocks + 40
    # Unknown (a formula profile, an older plan file): both moments stack everything, as before the trace said.
    unknown = mm.step_memory(UNITS, p, 4, cuda=False, act=mm.Activations(saved=500, peak=5000))
    assert unknown.peak("device") == states + 4 * ROOT + blocks + 5000


def test_streamed_params_on_host_optimizer_on_nvme():
    up = UnitPlacement(params=Tier.HOST, master=Tier.NVME, grads=Tier.NVME, optim=Tier.NVME)
    p = Placement(default=up, prefetch_depth=1)
    sm = mm.step_memory(UNITS, p, 4, cuda=False)
    # Window: the root (materialised forward start -> its grads) + running + 1 prefetched block in forward,
    # + the previous block in backward (released once its grads are shipped, after the running one started).
    assert sm.phases["forward"]["device"]["window"] == 4 * ROOT + 2 * 4 * BLOCK
    assert sm.phases["backward"]["device"]["window"] == 4 * ROOT + 3 * 4 * BLOCK
    assert sm.phases["backward"]["device"]["grads in flight"] == 4 * ROOT + 2 * 4 * BLOCK
    assert sm.phases["step"]["device"]["window"] == 0
    # Host tier: the fp32 params (master is separate: it lives on NVMe). NVMe: master 4 + grads 4 + moments 8.
    assert sm.phases["backward"]["host"]["states"] == 4 * ALL
    assert sm.peak("nvme") == 16 * ALL
    # Pool ([Note: the pool]): NVMe-bound grads leave a CPU device through ship jobs (the root's + two blocks'),
    # each a pack (4 B) and an fp32 accumulator (4 B) per element; no params on NVMe, so no fetch staging; the
    # root's step job + (depth + 1) blocks', each 4 (master) + 12 (grads, moments) bytes per element (the new
    # compute params are cast in place into the host tier).
    packs = 8 * ROOT + 2 * 8 * BLOCK
    optim = 16 * ROOT + 2 * 16 * BLOCK
    assert mm.pool_parts(UNITS, p, 4, cuda=False) == {"grad packs": packs, "fetch staging": 0, "optimizer": optim}
    assert all(sm.phases[ph]["host"]["buffers"] == packs + optim for ph in mm.PHASES)  # allocated once, kept
    assert mm.process_bytes(sm, cuda=False, floor=0) == (4 * ALL + packs + optim
                                                          + 2 * 4 * ROOT + 3 * 4 * BLOCK + 2 * 4 * BLOCK)


def test_minimum_is_backward_without_prefetch():
    up = UnitPlacement(params=Tier.HOST, master=Tier.HOST, grads=Tier.HOST, optim=Tier.HOST)
    p = Placement(default=up, prefetch_depth=3)
    # What `check_budgets` refuses below: the root + two blocks computing, with their grads.
    assert mm.device_minimum(UNITS, p, 4) == {"states": 0, "window": 4 * ROOT + 2 * 4 * BLOCK,
                                              "grads in flight": 4 * ROOT + 2 * 4 * BLOCK}
    # Depth 3 would want 5 block slots; only 3 blocks are streamed.
    assert mm.device_parts(UNITS, p, 4, "backward")["window"] == 4 * ROOT + 3 * 4 * BLOCK
    # Everything in host memory on a CPU device: stepped in place, gradients added in place: no pool at all.
    assert mm.pool_minimum(UNITS, p, 4, cuda=False) == 0
    assert sum(mm.pool_parts(UNITS, p, 4, cuda=False).values()) == 0
    # With a GPU every gradient leaves the device through a pack (page-locked: whole pages); master, grads and
    # moments all on the host are stepped in place there, so the packs are all the pool holds.
    def page(n):
        return -(-n // 4096) * 4096

    assert mm.pool_parts(UNITS, p, 4, cuda=True) == {"grad packs": page(4 * ROOT) + 2 * page(4 * BLOCK),
                                                     "fetch staging": 0, "optimizer": 0}
    assert mm.largest_job(UNITS, p, 4, separate=True) == (page(4 * ROOT), "ship root")


def test_resident_units_take_no_window_slot_and_bf16_keeps_a_master():
    on_dev = UnitPlacement.all_on(Tier.DEVICE)
    nvme = UnitPlacement.all_on(Tier.NVME)
    p = Placement(default=nvme, units={"root": on_dev, "blocks.0": on_dev}, prefetch_depth=2)
    c = 2  # bf16 compute: params 2 B, a separate fp32 master 4 B
    parts = mm.device_parts(UNITS, p, c, "backward")
    assert parts["states"] == (2 + 4 + 4 + 8) * (ROOT + BLOCK)
    assert parts["window"] == 2 * (2 * BLOCK)  # two streamed blocks: fewer than depth + 2 slots
    assert parts["grads in flight"] == 2 * ROOT + 2 * 2 * BLOCK
    # Pool: NVMe grads shipped (two blocks' bf16 pack and fp32 accumulator), params fetched from NVMe through
    # staging (running + 2 prefetched: but only two blocks are on NVMe), and (depth + 1, but two blocks) step jobs of
    # 4 (master) + 12 (grads, moments) + 2 (the cast of the new bf16 params, written to NVMe) bytes per element.
    assert mm.pool_parts(UNITS, p, c, cuda=False) == {"grad packs": 2 * 6 * BLOCK, "fetch staging": 2 * 2 * BLOCK,
                                                      "optimizer": 2 * 18 * BLOCK}
    assert mm.state_bytes(UNITS[1], mm.State.MASTER, nvme, c) == 4 * BLOCK


def test_pool_is_cut_to_the_room_but_never_below_one_working_set():
    p = Placement.everywhere(Tier.NVME, prefetch_depth=1)
    need = sum(mm.pool_parts(UNITS, p, 4, cuda=False).values())
    one = 16 * ROOT  # the root's step job is the largest: its fp32 params (its master), grads and moments
    assert mm.pool_minimum(UNITS, p, 4, cuda=False) == one
    assert mm.pool_bytes(UNITS, p, 4, cuda=False) == need
    assert mm.pool_bytes(UNITS, p, 4, cuda=False, room=need + 1) == need
    assert mm.pool_bytes(UNITS, p, 4, cuda=False, room=one + 5) == one + 5
    assert mm.pool_bytes(UNITS, p, 4, cuda=False, room=10) == one


def test_a_first_micro_batch_lands_as_its_sum_so_one_micro_batch_takes_no_pack():
    """[Note: gradients land converted]: a step's first gradients land as their fp32 sum, into the host tier's
    page-locked sum (no pool buffer) or, bound for NVMe, an fp32 pack that is the sum (no bf16 pack beside it).
    With one micro-batch a step the pool needs no more; with more, the later ones' packs; `wrap`'s minimum keeps
    the whole ship job (it does not know how many micro-batches a step has)."""
    def page(n):
        return -(-n // 4096) * 4096

    host, c = Placement.everywhere(Tier.HOST), 2  # bf16 on a GPU
    packs = page(2 * ROOT) + 2 * page(2 * BLOCK)
    assert mm.pool_parts(UNITS, host, c, cuda=True, accum=1)["grad packs"] == 0
    assert mm.pool_parts(UNITS, host, c, cuda=True, accum=2)["grad packs"] == packs
    assert mm.pool_parts(UNITS, host, c, cuda=True)["grad packs"] == packs  # any number
    assert mm.pool_bytes(UNITS, host, c, cuda=True, accum=1) == mm.pool_minimum(UNITS, host, c, cuda=True) \
        == page(2 * ROOT)
    # The plan's choice to pack a first micro-batch in bf16 (`land_grads_fp32` False): a pack for every one.
    bf16_packs = Placement.everywhere(Tier.HOST, land_grads_fp32=False)
    assert mm.pool_parts(UNITS, bf16_packs, c, cuda=True, accum=1)["grad packs"] == packs

    nvme = Placement.everywhere(Tier.NVME, nvme_dir="/swap")
    assert mm.pool_parts(UNITS, nvme, c, cuda=True, accum=1)["grad packs"] == page(4 * ROOT) + 2 * page(4 * BLOCK)
    later = page(2 * ROOT) + page(4 * ROOT) + 2 * (page(2 * BLOCK) + page(4 * BLOCK))
    assert mm.pool_parts(UNITS, nvme, c, cuda=True, accum=4)["grad packs"] == later
    # fp32 compute lands as the sum whatever the option: its pack is the compute dtype's already.
    assert mm.pool_parts(UNITS, nvme, 4, cuda=False, accum=1)["grad packs"] == 4 * ROOT + 2 * 4 * BLOCK
    assert mm.pool_parts(UNITS, nvme, 4, cuda=False, accum=2)["grad packs"] == 8 * ROOT + 2 * 8 * BLOCK

    # The engine's grants follow the same rule (step/gradients.py calls it): pageable host sums take a pack.
    ship = mm.unit_jobs(UNITS[1], host.of("blocks.0"), c, separate=True)["ship"]
    assert mm.ship_buffers(ship, as_sum=True) == {}
    assert mm.ship_buffers(ship, as_sum=True, locked=False) == ship == {"pack": (BLOCK, 2)}
    assert mm.ship_buffers(ship, as_sum=False) == ship
