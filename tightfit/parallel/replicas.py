"""Data parallelism over the offload engine: `--strategy ddp --offload host|nvme` on several ranks.

Each rank holds the whole model through its own offload engine, planned for that rank's share of the machine
(host memory divided among the node's ranks unless `--cpu-mem` gives a rank's; its own swap folder, `<nvme>/rank-R`,
which tightfit creates and removes), and trains on its share of each step's global batch (the one loop's
`TokenDataset.step_batches`). What makes the replicas one model:

[Note: gradients averaged as they leave] The engine's gradient shipper calls `GradientAverager` on a unit's
gradients on the device as its backward ends: asynchronous `all_reduce`s over the data-parallel group
(torch.distributed's, on a process group of its own so that no collective the loop issues can interleave with
them; one coalesced call per bucket on NCCL, one flat buffer on gloo: [Note: gloo through a flat buffer of our
own]), and, before anything reads them (the norms a clip needs, the sums on the host or NVMe, the unit's step), a
wait and a division by the group's size: in the copy off the device (its copy thread; on CUDA, ordered on the copy
stream), so the backward of the next units runs while the group adds, or at once where they are read at once. Every
rank's gradients are then the group's mean, bit for bit alike (an all-reduce hands every rank the same sum), so
every rank's norm, clip and AdamW step are alike and the replicas stay equal without a broadcast. Each rank reduces
the same units in the same order: the same model, the same schedule. Cost: once a step per unit in unit-major order
(its sums leave once); once per micro-batch in micro-batch-major order (each micro-batch's gradients leave), as DDP
without `no_sync`.

The main rank writes the checkpoints (any rank's state is the run's) in the one-process format, so a one-process
run, another world size, or another strategy resumes them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from tightfit.errors import UsageError
from tightfit.train.trainee import OneProcess, one_process

RANK_FOLDER = "rank-{:05d}"
"""A rank's swap folder inside `--nvme`: its own, so no two engines share a file or a lock."""
RANK_MARKER = ".tightfit-rank-swap"
"""In a rank's swap folder tightfit made: the folder is tightfit's to remove once empty, also after a run that was
killed left it (the next run on it takes its files back, as one process does with its swap files)."""


class GradientAverager:
    """Averages gradients in place over `group` (the data-parallel ranks): a call starts the all-reduces and returns
    what finishes them (waits, then divides), which the shipper runs before the gradients are read. Counts the bytes
    it reduced and the seconds spent waiting for them (on whichever thread waited).

    [Note: gloo through a flat buffer of our own] On gloo (host tensors) a call's gradients, which share a dtype,
    are copied into one flat buffer, all-reduced as one tensor and copied back divided: a coalesced gloo call would
    flatten them into a buffer of its own on every call, and those buffers, freed and allocated again beside the
    step's activations, left glibc's heap holding 90-100 MiB more free bytes at a 13 M-parameter model's peak (RSS
    15% over the plan against 7% without the average; benchmarks/RESULTS.md batch AK). The flat buffers are kept
    and reused (one per call in flight, as large as the largest unit's gradients; `averaging.allreduce_buffer_bytes`
    counts them), and the sums are the coalesced call's, bit for bit. NCCL groups a coalesced call's tensors in place
    with no copy: it keeps that path."""

    def __init__(self, group, size: int) -> None:
        self.group, self.size = group, size
        self.rank = dist.get_rank(group)
        self.through_flat = dist.get_backend(group) == "gloo"
        # ZeRO-2 over the engine (sharded_optimizer.py): unit name -> the rank its gradients are reduced to, which
        # alone receives their mean (None: every unit's averaged on every rank).
        self.owner_of: Callable[[str], int | None] | None = None
        self._free: list[torch.Tensor] = []  # flat buffers no call is using (list operations are atomic)
        self.bytes = 0
        self.seconds = 0.0

    def __call__(self, grads: list[torch.Tensor], unit: str | None = None) -> Callable[[], None]:
        dst = self.owner_of(unit) if self.owner_of is not None and unit is not None else None
        dtypes = {g.dtype for g in grads}
        if dst is not None or (self.through_flat and len(dtypes) == 1):
            # a ZeRO-2 reduce of mixed dtypes goes through fp32, which holds every bf16/fp16 value exactly
            return self._through_flat(grads, dtypes.pop() if len(dtypes) == 1 else torch.float32, dst)
        pending = []  # (work, its gradients): each bucket's all-reduces as one coalesced call, in place
        for bucket in buckets(grads):
            with _coalescing_manager(group=self.group, async_ops=True) as calls:
                for g in bucket:
                    dist.all_reduce(g, group=self.group, async_op=True)
            pending.append((calls, bucket))
            self.bytes += sum(g.numel() * g.element_size() for g in bucket)

        def averaged() -> None:
            t0 = time.perf_counter()
            for calls, bucket in pending:
                calls.wait()
                torch._foreach_div_(bucket, float(self.size))
            pending.clear()
            self.seconds += time.perf_counter() - t0

        return averaged

    def _through_flat(self, grads: list[torch.Tensor], dtype: torch.dtype, dst: int | None = None
                      ) -> Callable[[], None]:
        """One flat buffer of `dtype`'s all-reduce, or (`dst`: ZeRO-2) its reduce to rank `dst`, which alone copies
        the mean back (the others' gradients are dropped after it)."""
        n = sum(g.numel() for g in grads)
        buffer = self._take(n, dtype, grads[0].device)
        flat = buffer[:n]
        torch.cat([g.reshape(-1).to(dtype) for g in grads], out=flat)
        if dst is None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            work = dist.reduce(flat, dst=dst, group=self.group, async_op=True)
        self.bytes += n * flat.element_size()

        def averaged() -> None:
            t0 = time.perf_counter()
            work.wait()
            if dst is None or dst == self.rank:
                flat.div_(float(self.size))
                torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in
                                                                                            grads]), grads)])
            self._free.append(buffer)
            self.seconds += time.perf_counter() - t0

        return averaged

    def _take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kept flat buffer of at least `n` elements of `dtype` on `device`, or a new one."""
        for i, b in enumerate(self._free):
            if b.dtype == dtype and b.device == device and b.numel() >= n:
                return self._free.pop(i)
        return torch.empty(n, dtype=dtype, device=device)


BUCKET_BYTES = 25 << 20
"""The most one coalesced all-reduce carries (DDP's bucket): one call per bucket, not per gradient (each call is a
round of messages: 50 small ones cost a 2-rank step on the 2-core VM 75 ms, one per unit 14 ms, benchmarks/RESULTS.md
batch AI). A coalesced call reduces its tensors in place on NCCL (grouped calls); gloo flattens them into a host
buffer of its own, which this bound bounds. A gradient this large or larger goes alone."""


def buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`grads` in order, consecutive small ones together up to BUCKET_BYTES, each large one alone."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        n = g.numel() * g.element_size()
        if n >= BUCKET_BYTES:
            out.append([g])
            size = BUCKET_BYTES  # the next small one starts a new bucket
        elif out and size + n <= BUCKET_BYTES and len(out[-1]) and out[-1][0].dtype == g.dtype:
            out[-1].append(g)
            size += n
        else:
            out.append([g])
            size = n
    return out


class Replicated(OneProcess):
    """This rank's whole model through its engine (a OneProcess), one of `world.size` replicas kept equal by the
    gradients' average. `swap`: the rank's swap folder (None without NVMe), removed at `close` if tightfit `made` it
    and it is empty."""

    strategy = "ddp"
    """`--strategy`, as the run's lines and summary name it."""

    def __init__(self, inner: OneProcess, world, averager: GradientAverager, swap: Path | None, made: bool) -> None:
        super().__init__(inner.mem, inner.device, inner.dtype)
        self.world, self.averager, self.swap, self.made = world, averager, swap, made
        self.data_rank, self.data_ranks = world.rank, world.size

    def describe(self) -> str:
        swap = f"; swap files in {self.swap} on rank 0, {RANK_FOLDER.format(1)}... beside it on the others" \
            if self.swap is not None else ""
        return (f"tightfit: {self.world.size} ranks, strategy {self.strategy}, the offload engine on each "
                f"({self.arrangement()}{swap})\n{super().describe()}")

    def arrangement(self) -> str:
        """What the ranks share and how, for the run's first line."""
        return "rank 0's plan below; gradients averaged as they leave the device"

    def global_loss(self, local: torch.Tensor) -> float:
        t = local.detach().to(torch.float64).reshape(1).cpu()
        dist.all_reduce(t)
        return float(t[0]) / self.world.size

    def evaluate(self, batches) -> float:
        """Each rank its round-robin share (a replica needs no peer to run a forward), then one weighted mean."""
        mine = batches[self.world.rank::self.world.size]
        return self._mean_over_ranks(super().evaluate(mine) * len(mine) if mine else 0.0, len(mine))

    @staticmethod
    def _mean_over_ranks(total: float, count: int) -> float:
        """Every rank's sum of batch losses over every rank's count of batches (one all-reduce)."""
        t = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0] / t[1])

    def checkpoint_groups(self, hand_over: bool = False):
        return super().checkpoint_groups(hand_over) if self.world.is_main else None

    def export_hf(self, folder: str, meta_model: Callable[[], torch.nn.Module], check_finite: bool = False,
                  merge_lora: bool = False) -> None:
        failed = None
        if self.world.is_main:
            try:
                super().export_hf(folder, meta_model, check_finite, merge_lora)
            except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
                failed = e
        self._export_voted(failed)

    def _export_voted(self, failed: Exception | None) -> None:
        """Every rank learns whether rank 0's export failed; all raise if it did (rank 0 what failed)."""
        if self.world.any_rank(failed is not None, "the vote after rank 0 exported the Hugging Face folder"):
            raise failed if failed is not None else self.world.raised_everywhere(
                UsageError(f"rank {self.world.rank}: stopping: rank 0 could not export the Hugging Face folder"))

    def engine_counters(self):
        counters = super().engine_counters()
        if counters is not None:
            counters["allreduce_bytes"] = float(self.averager.bytes)
            counters["allreduce_wait_s"] = self.averager.seconds
        return counters

    def plan_record(self, step_seconds: float, run_seconds_per_step: float) -> dict | None:
        """Rank 0's plan against its measurement, with every rank's peaks beside it (each planned for its own share;
        one gather, every rank calls it at the run's end)."""
        record = super().plan_record(step_seconds, run_seconds_per_step)
        mine = None if record is None else {k: {"predicted": record["predicted"].get(k), "measured":
                                                record["measured"].get(k)} for k in ("rss_peak", "host_peak",
                                                                                     "nvme_peak")}
        ranks: list = [None] * self.world.size
        with self.world.collective("the gather of every rank's peaks"):
            dist.all_gather_object(ranks, mine)
        if record is not None:
            record["ranks"] = ranks
        return record

    def summary_fields(self) -> dict:
        return {"strategy": self.strategy, "mesh": [1, self.world.size, 1], "ranks": self.world.size, "engine": True}

    def close(self) -> None:
        super().close()
        remove_rank_folder(self.swap, self.made)


def remove_rank_folder(swap: Path | None, made: bool) -> None:
    """Remove the rank's swap folder if tightfit made it and its engine took its files back (only the marker
    left); a folder the user made, or one with anything else in it, stays."""
    if swap is None or not made:
        return
    try:
        if sorted(p.name for p in swap.iterdir()) == [RANK_MARKER]:
            (swap / RANK_MARKER).unlink()
            swap.rmdir()
    except OSError:
        pass


def average_over_ranks(engine, group=None) -> GradientAverager:
    """Make `engine` one replica of `group`'s: its gradients averaged as they leave the device. `group`: a process
    group of the gradients' own over every rank (no interleaving with other collectives); None makes one, which is
    collective: every rank calls it."""
    if group is None:
        group = dist.new_group(backend=dist.get_backend())
    averager = GradientAverager(group, dist.get_world_size(group))
    engine.shipper.reduce = averager
    return averager


def replicate(model: torch.nn.Module, cfg, world, device: torch.device, dtype: torch.dtype, resume,
              planned: Callable | None, say: Callable[[str], None], sharding: str | None = None,
              averaged: tuple | None = None) -> Replicated:
    """This rank's replica: `model` held by its own engine as its plan says, its gradients averaged over `world`.
    `sharding`: "zero1", each unit's master and moments on one rank alone; "zero2", and its gradients reduced to that
    rank (parallel/sharded_optimizer.py); "zero3", and its compute params held there, sent for each use
    (parallel/params_exchange.py). `averaged`: the gradients' group and its averaging, where `gradients_group`
    has measured them already (zero3_path.decide)."""
    from tightfit.offload.step.engine import find_engine
    from tightfit.parallel.rank_plan import rank_config
    from tightfit.planner.probe import load_or_probe

    mine, swap = rank_config(cfg, world.rank)
    inner, refused, made = None, None, False
    try:
        made = make_rank_folder(swap)
    except UsageError as e:
        refused = e
    # The machine's profile is measured once, by the main rank; the others read its cache.
    if world.is_main and refused is None:
        load_or_probe(str(swap) if swap is not None else None)
    world.barrier("the hardware probe")
    group, averaging = averaged or gradients_group(world, device, cfg)
    owner, exchange = None, None
    if sharding:
        from tightfit.parallel.sharded_optimizer import shard_averaging

        exchange = dist.new_group(backend=dist.get_backend())  # the exchange's and the norms' own
        # the gathers' (point to point between host tensors): gloo, also where the run's backend is NCCL
        gathers = exchange if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        owner, averaging = shard_averaging(model, world.rank, world.size, sharding, averaging)
        # ZeRO-3: the parameters' exchange, beside the other collectives, on a group of its own
        params_group = dist.new_group(backend=dist.get_backend()) if sharding == "zero3" else None
    if refused is None:
        try:
            inner = one_process(model, mine, device, dtype, resume, planned if world.is_main else None, say,
                                averaging)
        except UsageError as e:  # its own tiers refused it (a full swap disk, a budget)
            refused = e
    # A rank refused alone would leave the others waiting in their next collective: every rank stops here, and the
    # refused rank's line is the run's.
    if world.any_rank(refused is not None, "the vote after every rank set up its engine"):
        if inner is not None:
            inner.close()
        remove_rank_folder(swap, made)
        raise setup_refused(world.rank, refused)
    averager = average_over_ranks(find_engine(inner.model), group)
    if sharding == "zero3":
        from tightfit.parallel.params_exchange import exchange_params

        exchange_params(find_engine(inner.model), owner, params_group, world.collective)
    if sharding:
        from tightfit.parallel.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer(inner, world, averager, swap, made, owner, exchange, sharding, gathers)
    return Replicated(inner, world, averager, swap, made)


def gradients_group(world, device: torch.device, cfg):
    """(the gradients' own process group, its `links.Averaging` with the bus bandwidth measured in it now).
    Collective: every rank calls it."""
    from tightfit.parallel.links import measured
    from tightfit.parallel.rank_plan import local_ranks

    group = dist.new_group(backend=dist.get_backend())
    with world.collective("the all-reduce's bandwidth, measured before planning"):
        return group, measured(group, device, cfg.parallel.interconnect, local_ranks())


def make_rank_folder(swap: Path | None) -> bool:
    """Make this rank's swap folder (marked as tightfit's) unless it is there; whether tightfit made it (or made
    it in an earlier run that was killed). Something in the way is one line naming --nvme."""
    if swap is None:
        return False
    made = not swap.exists() or (swap / RANK_MARKER).is_file()
    try:
        swap.mkdir(parents=True, exist_ok=True)
        if made:
            (swap / RANK_MARKER).touch()
    except OSError as e:
        raise UsageError(f"--nvme: cannot use {swap} as this rank's swap folder ({e.strerror or e}); move what is "
                         "in the way, or point --nvme at another folder") from None
    return made


def setup_refused(rank: int, refused: UsageError | None) -> UsageError:
    """What a rank raises when a rank's engine could not be set up: the refused rank its own line, named by rank
    (the one the launcher prints for the run), every other rank a quiet stop."""
    if refused is not None:
        error = UsageError(f"rank {rank}: {refused}")
        error.exit_code = refused.exit_code
        return error
    error = UsageError(f"rank {rank}: stopping: another rank could not set up its offload engine")
    error.quiet = True
    return error
