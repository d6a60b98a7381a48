"""The memory of a training step under a placement: bytes per tier in each phase, from per-unit sizes.

Why one module: the engine refuses budgets that cannot hold a step (`budget_checks.check_budgets`, at wrap time)
and the planner predicts peaks and chooses the budgets it hands the engine (`tightfit/planner/costs.py`). Both call
the functions below, so the bytes that decide a refusal are the bytes the plan printed. It is arithmetic over
`UnitSize`s and a `Placement`, nothing else: no torch, no model, no measurement.

[Note: bytes per state] For a unit with N elements in its flat buffer (padding included), n of them trainable,
compute dtype of c bytes:
  params N*c; master n*4 (frozen parameters have none; and no master at all when c is 4 and it shares the
  params' tier: one tensor, `step/unit.py`); no params at rest where the device casts the master as it uploads it
  (`casts_on_device`);
  grads n*4 (fp32, accumulated over micro-batches); optim n*8 (Adam's two moments, fp32).
While a unit computes its backward, autograd's `param.grad`s add n*c on the device until they are shipped.

[Note: phases] The engine meters the device (device-tier states + materialised units + `param.grad`s not yet
shipped) and bounds its host buffer pool; the model follows the same three things through a step:
- forward: the root unit (materialised from forward start to its gradients) + the running block + `depth`
  prefetched ones; at its end the first `depth` units of backward stay materialised (the reuse distance).
- backward: the root + the running block + `depth` prefetched + the previous block (released once its gradients
  are shipped, which is after the running block has started: two units overlap), with the `param.grad`s of those
  two blocks and of the root. The root ships its gradients when the last of them arrived, so they pile up over
  backward; two moments bound the device:
  - "backward": the activations at their peak (backward's start, or a checkpointed block's recomputation), with the
    root's gradients that come before its last one (a language model's head and final norm);
  - "backward end": all the root's gradients (its embedding's arrives last), with the activations still live then
    (few). The engine's own count peaks here; without the trace's figures both moments take the activations' peak
    and all the root's gradients (the safe side).
- step: device-tier states only; the optimizer's buffers come from the pool.
Streamed blocks are those whose params are not on the device tier; fewer than `depth + 2` of them take fewer slots.
The smallest budget the schedule can live with is the backward phase at depth 0 (prefetches are optional: the
engine starts one only when it fits): `check_budgets` refuses anything below it.

[Note: the pool] Every host buffer of a transfer or an optimizer step is granted, per job, by one pool whose capacity
is the host budget less the host tier ([Note: jobs and grants] in runtime/host_memory.py). The pool keeps what it
allocated (idle buffers are reused, dropped only for another size), and what the engine holds ahead (preloaded
moments, kept fetch buffers, held gradients) is taken whenever its speculative share has room, so over a few steps
the pool grows to its capacity: its predicted bytes *are* its capacity. The planner therefore sizes the capacity
(`pool_bytes`) and hands the engine host budget = host tier + that, instead of all the RAM it has. In jobs
(`unit_jobs`, the very buffer sets the engine reserves), a capacity holds:
- the ships of gradients leaving the device (a GPU, or NVMe-bound gradients): two blocks' (the running block's and
  the previous one's) and the root's; a step's first micro-batch's land as their sum (`ship_buffers`), so with one
  micro-batch a step host-tier gradients take none and NVMe-bound ones their fp32 pack alone;
- the fetches of params from NVMe: the running block's and `depth` prefetched;
- the steps of units whose step goes through buffers: the one stepped + `depth` preloaded;
and never less than the largest single job, which the engine requires (`pool_minimum`): with that, no
interleaving of the jobs can deadlock.

[Note: the save] A checkpoint is taken between two steps, outside the engine's meters and its pool: each unit's
fp32 master and moments are read into fresh host buffers, a piece of EXPORT_PIECE bytes (or one larger parameter) at
a time, and handed to the writer thread, which holds what it has queued (CHECKPOINT_QUEUE) while the next piece
waits. So a save adds that much to what the process holds at rest: its floor, the host tier and the pool (and, on a
CPU-only machine, the device tier's states). It used to read a unit whole: a 3B Llama's root (394M embedding
parameters, 4.7 GB of master and moments) made the save, not backward, the run's peak, beyond its plan. Units whose
master and moments are NVMe files are copied file to file through 16 MiB buffers (`save_bytes`).

[Note: the last save takes the swap's place] After the run's last checkpoint nothing reads the swap files again:
the engine is closed and removes them. So that save removes each unit's swap file as soon as the unit's states
are in the checkpoint (copied from the file, or read into the writer's queue), and the disk holds a unit's swap
and its checkpoint shard at once for one unit at a time, not for the whole model (`handed_over`): a 3.4B Llama
with its states on NVMe keeps 46 GiB of swap beside a 38 GiB checkpoint otherwise.

Activations are the model's: the engine does not meter them. The planner passes its measured figures
(`Activations`) and the model adds them to the device in forward and backward. Nor does it meter the temporary in
which a GPU converts gradients to fp32 on their way to the host ([Note: gradients land converted] in
offload/step/gradients.py): at most `CONVERT_CHUNK` elements on the copy's stream in backward ("grad conversion"),
nor the one in which it casts an uploaded fp32 master ([Note: the device casts the master] in step/unit.py; "param
conversion", in forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier, UnitPlacement

PHASES = ("forward", "backward", "backward end", "step")


@dataclass(frozen=True)
class UnitSize:
    """What the memory model needs of one unit."""

    name: str
    """Unit name ("root", "blocks.3", "blocks.0-3")."""
    numel: int
    """Elements of the unit's flat buffer, padding included (all its parameters)."""
    trainable: int
    """Elements of its trainable prefix: these have gradients and Adam moments."""
    stepped: bool = True
    """This process steps the unit: it holds its fp32 master and moments. False: another rank does and sends its
    updated values ([Note: optimizer states sharded by unit] in tightfit/parallel/sharded_optimizer.py); the unit
    keeps its compute params and (unless `keeps_grads` is False) its gradients here."""
    keeps_grads: bool = True
    """Its gradients are summed here. False (a unit another rank steps, under ZeRO-2): they are reduced to that
    rank as they leave the device and dropped; nothing of them lands here."""
    holds_params: bool = True
    """Its compute params are kept here. False (a unit another rank steps, under ZeRO-3): that rank holds them and
    sends them for each use ([Note: parameters sent for each use] in tightfit/parallel/params_exchange.py)."""
    exchanged: bool = False
    """Every use of its params (on each rank, its owner's too) comes through the exchange's buffers, not a fetch from
    its tier: no fetch staging of its own (ZeRO-3, a unit one rank owns)."""

    @property
    def is_root(self) -> bool:
        return self.name == ROOT_UNIT


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on the device (the planner's meta-device trace measures them)."""

    saved: int = 0
    """Kept from forward to backward (a checkpointed unit keeps its input only): the device at forward's end."""
    peak: int = 0
    """The most live at once, in backward: saved + one checkpointed unit's recomputation + gradients of
    activations and the running op's temporaries."""
    root_grads_early: int | None = None
    """Bytes of the root's `param.grad`s that arrive before its last one, in flight at `peak` ("backward" in
    [Note: phases]); None: all of them."""
    at_root_end: int | None = None
    """Activation bytes live once all the root's `param.grad`s are ("backward end"); None: `peak`."""
    host_saved: int = 0
    """Bytes saved for backward in page-locked host memory instead ([Note: boundaries on the host] in
    step/boundaries.py): the buffers are kept from step to step, so they count in every phase."""


# ---- per unit ([Note: bytes per state]) --------------------------------------------------------------------------

def casts_on_device(u: UnitSize, up: UnitPlacement, c: int, enabled: bool) -> bool:
    """Does a fetch of unit `u` upload its fp32 master for the device to cast, with no compute copy on the host
    (`enabled`: `Placement.cast_on_device`; [Note: the device casts the master] in step/unit.py)? Only where the
    master is the whole unit (no frozen tail kept in the compute dtype) and lives on the host tier, as the params
    would."""
    return (enabled and c < 4 and u.trainable == u.numel > 0 and u.stepped
            and up.params == up.master == Tier.HOST)


def state_bytes(u: UnitSize, state: State, up: UnitPlacement, c: int, casts: bool = False) -> int:
    """Bytes `state` of unit `u` occupies on its tier (c: bytes per compute element; `casts`: `casts_on_device`, no
    compute copy at rest)."""
    if state is State.PARAMS:
        return 0 if casts or not u.holds_params else u.numel * c
    if state is State.MASTER:  # frozen, or stepped by another rank: no master
        return 0 if (c == 4 and up.master == up.params) or not u.stepped else u.trainable * 4
    if state is State.GRADS:
        return u.trainable * 4 if u.keeps_grads else 0
    return u.trainable * 8 if u.stepped else 0


def params_bytes(u: UnitSize, c: int) -> int:
    """A materialised unit's flat buffer on the device."""
    return u.numel * c


def streams(u: UnitSize, p: Placement) -> bool:
    """Are the unit's params brought to the device for each use (not resident there)? Those of a unit another rank
    holds always are."""
    return p.of(u.name).params != Tier.DEVICE or not u.holds_params


EXCHANGE_AHEAD = 2
"""Uses of exchanged units (ZeRO-3) each rank's exchange requests ahead of the one computing: the same on every rank,
as the broadcasts' order must be ([Note: parameters sent for each use] in tightfit/parallel/params_exchange.py)."""
EXCHANGE_SLOTS = EXCHANGE_AHEAD + 2
"""Host buffers of the exchange for the blocks, each the largest exchanged block's compute params: the uses requested
ahead, the one computing and one whose copy to the device is finishing. The root, used once a forward phase, has
one buffer of its own size."""


def exchange_buffer_bytes(units: list[UnitSize], c: int) -> int:
    """Host bytes of the exchange's buffers (0 where no unit is exchanged)."""
    roots, blocks = _split([u for u in units if u.exchanged])
    return (EXCHANGE_SLOTS * max((params_bytes(u, c) for u in blocks), default=0)
            + sum(params_bytes(u, c) for u in roots))


def exchange_wire_bytes(units: list[UnitSize], c: int) -> int:
    """Device bytes of the exchange's wire on a GPU ([Note: the wire's device buffer] in tightfit/parallel/wire.py):
    the largest unit it sends, the exchanged units' (ZeRO-3) or, where other ranks step units (ZeRO-1/2), every
    trainable unit's; 0 where the ranks exchange nothing."""
    if any(u.exchanged for u in units):
        sent = [u for u in units if u.exchanged]
    elif any(not u.stepped for u in units):
        sent = [u for u in units if u.trainable]
    else:
        return 0
    return max(params_bytes(u, c) for u in sent)


def autograd_grad_bytes(u: UnitSize, c: int, sums: bool = False) -> int:
    """The `param.grad`s autograd makes for the unit in one backward (compute dtype), until shipped; `sums`: with
    the fp32 sums a unit-major pass folds them into where the compute dtype is narrower (step/unit.py)."""
    return u.trainable * (c + (4 if sums and c < 4 else 0))


PINNED_ENTRIES = ("params", "grads")
"""The host tier's entries a GPU copies into or out of asynchronously, page-locked (tiers/stores.py); a master the
device casts as it uploads it is one more (`casts_on_device`)."""
PAGE = 4096
"""What a page-locked staging buffer is rounded up to (host_memory.RegisteredAllocator: one mapping per buffer)."""
CONVERT_CHUNK = 1 << 20
"""Elements a GPU converts at a time: a gradient to fp32 on its way to an fp32 host sum (CudaMover.pack_grads in
runtime/movers.py), an uploaded fp32 master to the compute dtype (CudaMover.fetch): a 4 MiB temporary at most, whose
copy (~80 us at 50 GB/s) outlasts its two launches."""


def host_addressable(tier: Tier, separate: bool) -> bool:
    """Can the CPU work on `tier`'s tensors in place? The host tier always; the device tier when device memory is
    host memory (a CPU device that shares it, `separate` False)."""
    return tier == Tier.HOST or (tier == Tier.DEVICE and not separate)


def unit_jobs(u: UnitSize, up: UnitPlacement, c: int, separate: bool) -> dict[str, dict[str, tuple[int, int]]]:
    """The host buffers each job of unit `u` is granted at once ([Note: jobs and grants] in runtime/host_memory.py):
    job -> buffer -> (numel, bytes per element). The engine reserves exactly these (step/jobs.py), `wrap` refuses a
    pool smaller than the largest, and the planner sizes the pool from them (`pool_parts`).

    - "fetch": the params from NVMe pass through a staging buffer on their way to the device.
    - "ship": gradients that leave the device (device memory apart from the host, or bound for NVMe) are packed in
      their own dtype and, bound for NVMe, accumulated in fp32 (the old gradients read into the same buffer).
    - "step": an optimizer step on the CPU works on a buffer for each of master, gradients and moments not in
      host-addressable memory, and casts new compute params into a buffer when they go to a tier that is not memory
      where the step ran. (fp32 params that are their own master: one buffer of the whole flat size.) A step of
      master, gradients and moments all on the device runs there."""
    n, big = u.trainable, u.numel
    jobs: dict[str, dict[str, tuple[int, int]]] = {}
    if up.params == Tier.NVME and not u.exchanged:
        jobs["fetch"] = {"params": (big, c)}
    if not n:
        return jobs
    # Not addressable where computed: a ship (none for another rank's gradients under ZeRO-2, which do not land).
    if u.keeps_grads and (up.grads == Tier.NVME or (up.grads == Tier.HOST and separate)):
        jobs["ship"] = {"pack": (n, c), **({"grads": (n, 4)} if up.grads == Tier.NVME else {})}
    if not u.stepped:  # another rank steps it
        return jobs
    on_device = up.master == up.grads == up.optim == Tier.DEVICE
    master_is_params = c == 4 and up.master == up.params
    step: dict[str, tuple[int, int]] = {}
    if not on_device:
        if not host_addressable(up.master, separate):
            step.update({"params": (big, 4)} if master_is_params else {"master": (n, 4)})
        if not host_addressable(up.grads, separate):
            step["grads"] = (n, 4)
        if not host_addressable(up.optim, separate):
            step.update(exp_avg=(n, 4), exp_avg_sq=(n, 4))
    # The new compute params, cast from the master where the step ran, go to a tier that is not memory there.
    if not master_is_params and (up.params == Tier.NVME or (not on_device and not host_addressable(up.params,
                                                                                                   separate))):
        step["cast"] = (n, c)
    if step:
        jobs["step"] = step
    return jobs


def first_lands_as_sum(c: int, land_grads_fp32: bool) -> bool:
    """Do a step's first micro-batch's gradients leave the device as fp32 and land as their sum? ([Note: gradients
    land converted] in step/gradients.py: fp32 compute always; a narrower one unless `Placement.land_grads_fp32` is
    False.)"""
    return c == 4 or land_grads_fp32


def ship_buffers(ship: dict[str, tuple[int, int]], as_sum: bool, locked: bool = True) -> dict[str, tuple[int, int]]:
    """The buffers a ship (`unit_jobs`' "ship") is granted for one micro-batch's gradients. `as_sum`: they have
    nothing to add to and land as their fp32 sum ([Note: gradients land converted] in step/gradients.py): an
    NVMe-bound unit's fp32 pack is that sum (its accumulator alone), and the host tier's sum takes them itself
    where it is page-locked (`locked`; pageable, they come through a pack as later micro-batches' do)."""
    if not as_sum or not ship:
        return ship
    if "grads" in ship:
        return {"pack": ship["grads"]}
    return {} if locked else ship


def job_bytes(buffers: dict[str, tuple[int, int]], separate: bool) -> int:
    """Pool bytes of one job's buffers: page-rounded where the pool page-locks them (`separate`)."""
    if not separate:
        return sum(n * e for n, e in buffers.values())
    return sum(-(-n * e // PAGE) * PAGE for n, e in buffers.values())


def largest_job(units: list[UnitSize], p: Placement, c: int, separate: bool) -> tuple[int, str]:
    """(bytes, "job of unit") of the largest buffer set any job asks for: the smallest pool that can run a step."""
    best = (0, "")
    for u in units:
        for job, bufs in unit_jobs(u, p.of(u.name), c, separate).items():
            best = max(best, (job_bytes(bufs, separate), f"{job} {u.name}"))
    return best


def pool_minimum(units: list[UnitSize], p: Placement, c: int, cuda: bool) -> int:
    """The smallest pool the engine accepts: the largest single job (`largest_job`), a ship's whole pack among them:
    a step's later micro-batches, and a first one where the host will not page-lock its sum, need it, and `wrap`
    does not know how many micro-batches a step has."""
    return largest_job(units, p, c, cuda)[0]


def pool_parts(units: list[UnitSize], p: Placement, c: int, cuda: bool,
               depth: int | None = None, accum: int | None = None) -> dict[str, int]:
    """What a pool needs for the schedule at prefetch `depth` to run without waiting for buffers ([Note: the pool]),
    in jobs (`unit_jobs`): "grad packs" (the root's ship and two blocks': backward overlaps two), "fetch staging"
    (the root's and the running block's + `depth` prefetched) and "optimizer" (the root's step and the stepped
    block's + `depth` loading ahead). `cuda`: device memory apart from the host (a GPU, or the CPU suite's
    GPU-shaped device). `accum`: micro-batches a step has (None: any number); a ship of a step's first lands as the
    sum (`ship_buffers`), so with one micro-batch host-tier gradients take no pack."""
    depth = p.prefetch_depth if depth is None else depth
    first_as_sum = first_lands_as_sum(c, p.land_grads_fp32)

    def job(u: UnitSize, name: str) -> int:
        bufs = unit_jobs(u, p.of(u.name), c, cuda).get(name, {})
        if name != "ship":
            return job_bytes(bufs, cuda)
        ships = [ship_buffers(bufs, first_as_sum)] + ([bufs] if accum is None or accum > 1 else [])
        return max(job_bytes(b, cuda) for b in ships)

    def part(name: str, blocks: int) -> int:
        sizes = [(u.is_root, job(u, name)) for u in units]
        having = [b for root, b in sizes if not root and b]  # blocks with such a job (a rank steps only its own)
        return sum(b for root, b in sizes if root) + min(blocks, len(having)) * max(having, default=0)

    return {"grad packs": part("ship", 2), "fetch staging": part("fetch", depth + 1),
            "optimizer": part("step", depth + 1)}


def pool_bytes(units: list[UnitSize], p: Placement, c: int, cuda: bool, room: int | None = None,
               depth: int | None = None, accum: int | None = None) -> int:
    """The pool capacity a plan gives the engine: what the schedule needs (`pool_parts`), cut to `room` (the
    host bytes left; the engine then waits for buffers instead of growing), but never below `pool_minimum`."""
    want = sum(pool_parts(units, p, c, cuda, depth, accum).values())
    if room is not None:
        want = min(want, max(0, room))
    return max(want, pool_minimum(units, p, c, cuda))


# ---- a checkpoint's save ([Note: the save]) -----------------------------------------------------------------------

CHECKPOINT_QUEUE = 256 << 20
"""Bytes of units the checkpoint writer holds queued for the disk (tightfit/train/checkpoint_writer.py: `put`
blocks past it, but always admits one group when the queue is empty)."""
EXPORT_PIECE = 64 << 20
"""Bytes of one piece of a unit's export (state_io.export_pieces): what a save reads from the tiers at once, beyond
one parameter larger than that."""
COPY_BUFFERS = 2 * (16 << 20)
"""A unit copied file to file: the trainer's copy block and the writer's read-back piece."""


def copied_by_file(u: UnitSize, up: UnitPlacement) -> bool:
    """A unit whose fp32 master and moments are NVMe files, all its parameters trainable: its checkpoint shard is a
    copy of byte ranges of those files (tightfit/train/checkpoint_swap.py), not a pass through memory."""
    return up.master == Tier.NVME and up.optim == Tier.NVME and u.trainable == u.numel and u.stepped


def export_bytes(u: UnitSize) -> int:
    """Host bytes of a unit's whole export: its fp32 master and two moments (state_io)."""
    return 4 * u.numel + 8 * u.trainable


def handed_over(units: list[UnitSize], p: Placement, c: int) -> int:
    """[Note: the last save takes the swap's place] Bytes of disk the run's last save needs less than a whole
    checkpoint: each unit adds its checkpoint bytes (`export_bytes`) and then gives back its swap file (its states
    on the NVMe tier), so the disk holds both at once for one unit at most."""
    both = []
    for u in units:
        up = p.of(u.name)
        casts = casts_on_device(u, up, c, p.cast_on_device)
        swap = sum(state_bytes(u, s, up, c, casts) for s in State if up.tier(s) == Tier.NVME)
        both.append(min(export_bytes(u), swap))
    return sum(both) - max(both, default=0)


def save_bytes(units: list[UnitSize], p: Placement, largest_param: int = 0) -> int:
    """[Note: the save] Host bytes a checkpoint's save holds beyond the process at rest: the writer's queue (up to
    CHECKPOINT_QUEUE, or one piece larger than that) and the next piece read while it waits for room; a piece is
    EXPORT_PIECE bytes or one fp32 parameter of `largest_param` elements. Never more than the units read through
    memory export in all; units copied by file add their copy buffers."""
    read = [export_bytes(u) for u in units if not copied_by_file(u, p.of(u.name))]
    copies = COPY_BUFFERS if len(read) < len(units) else 0
    if not read:
        return copies
    piece = max(EXPORT_PIECE, 4 * largest_param)
    return min(sum(read), max(CHECKPOINT_QUEUE, piece) + piece) + copies


# ---- per tier ----------------------------------------------------------------------------------------------------

def tier_states(units: list[UnitSize], p: Placement, c: int, separate: bool = False) -> dict[Tier, int]:
    """Bytes of every unit's states on each tier. `separate` (device memory apart from the host's): the host tier's
    compute params and gradients (and a master the device casts from) are page-locked for the copies to and from
    the device, one mapping each, so each is rounded up to PAGE (stores.MemoryStore,
    host_memory.RegisteredAllocator)."""
    out = dict.fromkeys(Tier, 0)
    for u in units:
        up = p.of(u.name)
        casts = casts_on_device(u, up, c, p.cast_on_device)
        locked = (State.PARAMS, State.GRADS, State.MASTER) if casts else (State.PARAMS, State.GRADS)
        for s in State:
            n = state_bytes(u, s, up, c, casts)
            if separate and n and s in locked and up.tier(s) == Tier.HOST:
                n = -(-n // PAGE) * PAGE
            out[up.tier(s)] += n
    return out


def _split(units: list[UnitSize]) -> tuple[list[UnitSize], list[UnitSize]]:
    return [u for u in units if u.is_root], [u for u in units if not u.is_root]


def device_parts(units: list[UnitSize], p: Placement, c: int, phase: str = "backward",
                 depth: int | None = None, sums: bool = False) -> dict[str, int]:
    """What the engine counts on the device in `phase` ([Note: phases]): "states", "window" (materialised units'
    params) and "grads in flight" (autograd's, not yet shipped). `depth`: prefetch depth (the placement's if None).
    `sums`: a unit-major pass, whose units in backward also hold their gradients' fp32 sums ([Note: gradient sums
    on the device] in step/unit.py)."""
    depth = p.prefetch_depth if depth is None else depth
    roots, blocks = _split(units)
    streamed = [u for u in blocks if streams(u, p)]
    block = max((params_bytes(u, c) for u in streamed), default=0)
    root = sum(params_bytes(u, c) for u in roots if streams(u, p))
    slots = {"forward": depth + 1, "backward": depth + 2, "backward end": depth + 2, "step": 0}[phase]
    parts = {"states": tier_states(units, p, c)[Tier.DEVICE],
             "window": (root + min(slots, len(streamed)) * block) if phase != "step" else 0,
             "grads in flight": 0}
    if phase.startswith("backward"):
        with_grads = [autograd_grad_bytes(u, c, sums) for u in blocks if u.trainable]
        parts["grads in flight"] = (sum(autograd_grad_bytes(u, c, sums) for u in roots)
                                    + min(2, len(with_grads)) * max(with_grads, default=0))
    return parts


def device_minimum(units: list[UnitSize], p: Placement, c: int) -> dict[str, int]:
    """The smallest device budget the schedule can live with: the backward phase without prefetching."""
    return device_parts(units, p, c, "backward", depth=0)


@dataclass
class StepMemory:
    """Bytes per phase, per tier, per component ([Note: phases]). Tiers: "device", "host", "nvme"."""

    phases: dict[str, dict[str, dict[str, int]]]
    """phase -> tier -> component -> bytes."""

    def at(self, phase: str, tier: str) -> int:
        return sum(self.phases[phase][tier].values())

    def peak(self, tier: str) -> int:
        return max(self.at(ph, tier) for ph in PHASES)

    def peak_parts(self, tier: str) -> dict[str, int]:
        """The components of `tier` in the phase of its peak."""
        phase = max(PHASES, key=lambda ph: self.at(ph, tier))
        return dict(self.phases[phase][tier])

    def engine_device(self) -> int:
        """The engine's own device count at its peak (everything but activations, the libraries' workspace and the
        gradients' conversion)."""
        return max(self.at(ph, "device") - sum(self.phases[ph]["device"].get(k, 0) for k in UNMETERED)
                   for ph in PHASES)


UNMETERED = ("activations", "workspace", "grad conversion", "param conversion")
"""Device components the engine's own count leaves out."""


def upload_conversion_bytes(units: list[UnitSize], p: Placement, c: int) -> int:
    """Device bytes of the temporary in which a GPU casts an uploaded fp32 master to the compute dtype
    (`casts_on_device`): the largest chunk any such unit converts, on the upload's stream in forward and backward."""
    return _chunk_bytes([u.numel for u in units if casts_on_device(u, p.of(u.name), c, p.cast_on_device)])


def conversion_bytes(units: list[UnitSize], p: Placement, c: int) -> int:
    """Device bytes of the temporary in which a GPU converts gradients to fp32 on their way to the host: the largest
    chunk any unit whose gradients leave the device converts (none when they are fp32 already, or leave in the
    compute dtype: `Placement.land_grads_fp32` False)."""
    if c == 4 or not p.land_grads_fp32:
        return 0
    return _chunk_bytes([u.trainable for u in units
                         if u.trainable and u.keeps_grads and p.of(u.name).grads != Tier.DEVICE])


def _chunk_bytes(numels: list[int]) -> int:
    """The fp32 temporary of a conversion `CONVERT_CHUNK` elements at a time, over tensors of these sizes."""
    return 4 * min(CONVERT_CHUNK, max(numels, default=0))


def step_memory(units: list[UnitSize], p: Placement, c: int, cuda: bool, act: Activations | None = None,
                pool: int | None = None, separate: bool | None = None, workspace: int = 0,
                sums: bool = False) -> StepMemory:
    """Bytes of every phase of one step of `units` under `p` ([Note: phases]). `pool`: the pool's capacity
    (default: `pool_bytes` with no room limit); it is allocated from the first step on, so it counts in every
    phase. `act`: activations, counted on the device in forward (saved) and backward (peak). `sums`: a unit-major
    pass (`device_parts`)."""
    act = act or Activations()
    states = tier_states(units, p, c, cuda if separate is None else separate)
    pool = pool_bytes(units, p, c, cuda) if pool is None else pool
    out: dict[str, dict[str, dict[str, int]]] = {}
    root_grads = sum(autograd_grad_bytes(u, c, sums) for u in units if u.is_root)
    early = root_grads if act.root_grads_early is None else min(root_grads, act.root_grads_early)
    late = act.peak if act.at_root_end is None else min(act.peak, act.at_root_end)
    convert = conversion_bytes(units, p, c) if cuda else 0
    upload = upload_conversion_bytes(units, p, c) if cuda else 0
    exchange = exchange_buffer_bytes(units, c)
    wire = exchange_wire_bytes(units, c) if (cuda if separate is None else separate) else 0
    for phase in PHASES:
        dev = device_parts(units, p, c, phase, sums=sums)
        if phase == "backward":  # the root's last gradient is not there yet
            dev["grads in flight"] -= root_grads - early
        dev["activations"] = {"forward": act.saved, "backward": act.peak, "backward end": late, "step": 0}[phase]
        if workspace:
            dev["workspace"] = workspace  # the math libraries' (cuBLAS's), held from the first matmul on
        if convert and phase.startswith("backward"):
            dev["grad conversion"] = convert
        if upload and phase != "step":
            dev["param conversion"] = upload
        if wire:
            dev["exchange wire"] = wire  # allocated with the exchange, for the whole run
        host = {"states": states[Tier.HOST], "buffers": pool}
        if exchange:
            host["exchange"] = exchange
        if act.host_saved:
            host["boundaries"] = act.host_saved
        out[phase] = {"device": dev, "host": host, "nvme": {"states": states[Tier.NVME]}}
    return StepMemory(out)


def process_bytes(mem: StepMemory, cuda: bool, floor: int) -> int:
    """Peak RSS of the training process: its floor (the runtime, the data, ...) + the host tier and pool, + on a
    CPU-only machine the device (it is the same RAM), taken phase by phase."""
    tiers = ("host",) if cuda else ("host", "device")
    return floor + max(sum(mem.at(ph, t) for t in tiers) for ph in PHASES)
