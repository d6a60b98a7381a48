"""`ParallelPlan`: which parallelisms a run uses and with what degrees, parsed from `--strategy`.

Why a plan object: `--strategy`, `--tp`, `--pp`, `--pp-schedule`, `--pp-microbatches` and the world size together
decide one thing — a mesh shape plus how the data-parallel dimension is realised. Resolving them once (with errors
that name the flag) keeps `parallelize()` free of string tests.

Strategy strings are `_`-joined tokens: `dp`/`ddp` (replicas with gradient all-reduce), `zero1`/`zero2`/`zero3`
(data parallel with ZeRO sharding; see data_parallel.py for the mapping), `tp`, `pp`. Examples: `ddp`, `zero3`,
`tp`, `pp`, `dp_tp`, `dp_pp`, `pp_tp`, `dp_pp_tp`, `zero1_pp_tp` (ZeRO-1 with PP and TP). Degrees not given by
`--tp`/`--pp` are chosen: TP takes what the other dimensions leave (it is limited to one node), PP likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tightfit.errors import UsageError
from tightfit.parallel.mesh import ParallelDims

DP_MODES = ("ddp", "zero1", "zero2", "zero3")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class ParallelPlan:
    """Mesh degrees plus the knobs of each parallelism."""

    dims: ParallelDims = ParallelDims()
    """Degrees of pp, dp, tp."""
    dp_mode: str = "ddp"
    """How the dp dimension is realised: ddp, zero1, zero2, zero3 (ignored when dp == 1, except zero3 offload)."""
    cpu_offload: bool = False
    """ZeRO-3 only: keep sharded parameters, gradients and optimizer states in host memory (FSDP2 CPUOffloadPolicy)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (bounded in-flight activations)."""
    pp_microbatches: int = 4
    """Micro-batches per step; the bubble is (pp-1)/(m+pp-1)."""
    kept_on_device: tuple[tuple[str, int], ...] = ()
    """With `cpu_offload`: the units (their names, `data_parallel.unit_name`, with one rank's shard's elements) whose
    shards, gradients and moments stay on the device; the others' go to host memory (parallel/unit_split.py)."""
    engine: bool = False
    """Pure data parallelism only: every rank runs its own offload engine, each state on that rank's tiers as the
    planner places it, gradients averaged over dp as they leave the device (replicas.py); with zero1 each unit's
    master and moments on one rank alone, with zero2 its gradients too (sharded_optimizer.py), with zero3 its
    compute params too, sent for each use (params_exchange.py)."""

    def __post_init__(self) -> None:
        if self.dp_mode not in DP_MODES:
            raise UsageError(f"--strategy: data-parallel mode {self.dp_mode!r} is not one of {', '.join(DP_MODES)}")
        if self.pp_schedule not in SCHEDULES:
            raise UsageError(f"--pp-schedule: {self.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.pp_microbatches < 1:
            raise UsageError("--pp-microbatches: must be a positive integer")
        if self.cpu_offload and self.dp_mode != "zero3":
            raise UsageError("CPU offload of sharded states needs --strategy zero3")
        if self.kept_on_device and not self.cpu_offload:
            raise UsageError("units kept on the device are the exceptions to a CPU offload: set cpu_offload")
        if self.engine and (self.cpu_offload or self.dims.pp > 1 or self.dims.tp > 1):
            raise UsageError("the offload engine on every rank is for pure data parallelism: --strategy ddp, zero1, "
                             "zero2 or zero3")
        if self.pp_schedule == "1f1b" and 1 < self.dims.pp > self.pp_microbatches:
            raise UsageError(f"--pp-microbatches {self.pp_microbatches}: 1F1B needs at least one micro-batch per "
                             f"stage ({self.dims.pp}); raise it or use --pp-schedule gpipe")

    @property
    def kept_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.kept_on_device)

    @property
    def name(self) -> str:
        parts = []
        if self.dims.dp > 1:
            parts.append(self.dp_mode)
        if self.dims.pp > 1:
            parts.append("pp")
        if self.dims.tp > 1:
            parts.append("tp")
        return "_".join(parts) or "single"


def parse_strategy(strategy: str, world_size: int, tp: int = 0, pp: int = 0, pp_schedule: str = "1f1b",
                   pp_microbatches: int = 4, cpu_offload: bool = False) -> ParallelPlan:
    """Resolve a strategy string and the world size into a plan. `tp`/`pp` of 0 mean "choose"."""
    tokens = [t for t in strategy.replace("+", "_").split("_") if t]
    known = {"dp", "ddp", "pp", "tp", *DP_MODES}
    bad = [t for t in tokens if t not in known]
    if not tokens or bad:
        raise UsageError(f"--strategy: cannot read {strategy!r}; use tokens dp, ddp, zero1, zero2, zero3, pp, tp "
                         "joined by '_' (e.g. dp_pp_tp, zero1_pp)")
    modes = [t for t in tokens if t in DP_MODES]
    if len(modes) > 1:
        raise UsageError(f"--strategy: {strategy!r} names several data-parallel modes ({', '.join(modes)})")
    has_dp = bool(modes) or "dp" in tokens
    dp_mode = modes[0] if modes else "ddp"
    has_pp, has_tp = "pp" in tokens, "tp" in tokens
    if tp and not has_tp:
        raise UsageError(f"--tp {tp}: strategy {strategy!r} has no tensor parallelism; add tp (e.g. dp_tp)")
    if pp and not has_pp:
        raise UsageError(f"--pp {pp}: strategy {strategy!r} has no pipeline parallelism; add pp (e.g. dp_pp)")
    for flag, value in (("--tp", tp), ("--pp", pp)):
        if value and world_size % value:
            raise UsageError(f"{flag} {value}: must divide the number of processes ({world_size})")
    # Dimensions without an explicit degree: with dp present, each chosen dimension defaults to 2 (the smallest
    # split); without dp, the last unspecified dimension takes the rest of the world.
    tp_deg, pp_deg = (tp or 0) if has_tp else 1, (pp or 0) if has_pp else 1
    free = [n for n, v in (("pp", pp_deg), ("tp", tp_deg)) if v == 0]
    if has_dp:
        for n in free:
            if n == "pp":
                pp_deg = 2
            else:
                tp_deg = 2
    elif free:
        fixed = (pp_deg or 1) * (tp_deg or 1)
        if len(free) == 2:
            pp_deg = 2
            fixed = 2
        rest = world_size // fixed if world_size % fixed == 0 else 0
        if free[-1] == "tp":
            tp_deg = rest
        else:
            pp_deg = rest
    if not tp_deg or not pp_deg or world_size % (tp_deg * pp_deg):
        raise UsageError(f"--strategy {strategy}: cannot split {world_size} processes into pp={pp_deg or '?'} x "
                         f"tp={tp_deg or '?'}; set --tp/--pp to divisors of the world size")
    dp_deg = world_size // (tp_deg * pp_deg)
    if dp_deg > 1 and not has_dp:
        raise UsageError(f"--strategy {strategy}: pp={pp_deg} x tp={tp_deg} uses {pp_deg * tp_deg} of {world_size} "
                         f"processes; add dp to the strategy or set --tp/--pp so their product is {world_size}")
    if has_dp and dp_deg == 1 and world_size > 1 and dp_mode != "zero3":
        raise UsageError(f"--strategy {strategy}: no processes left for data parallelism (world {world_size})")
    return ParallelPlan(ParallelDims(pp=pp_deg, dp=dp_deg, tp=tp_deg), dp_mode, cpu_offload, pp_schedule,
                        pp_microbatches)


def plan_from_config(pcfg, world_size: int, offload: str = "auto") -> ParallelPlan:
    """The plan for a `tightfit.config.ParallelConfig` section (strategy 'auto' must be resolved before).

    `offload` is `--offload`: `host` or `nvme` with pure data parallelism puts the offload engine on every rank (each
    state on that rank's host memory or NVMe as its plan says: replicas.py; zero1/zero2/zero3 shard the states by
    unit: sharded_optimizer.py, params_exchange.py). `auto` keeps torch's DDP and FSDP2 as they are (FSDP2's
    CPUOffloadPolicy where `--strategy auto` chooses it).
    """
    from dataclasses import replace

    if pcfg.strategy == "auto":
        raise UsageError("--strategy auto: resolve it with tightfit.parallel.auto.choose_strategy first")
    plan = parse_strategy(pcfg.strategy, world_size, pcfg.tp, pcfg.pp, pcfg.pp_schedule, pcfg.pp_microbatches)
    if offload in ("host", "nvme") and plan.dims.pp == plan.dims.tp == 1:
        return replace(plan, engine=True)
    if offload in ("host", "nvme"):
        raise UsageError(f"--offload {offload} with several processes: --strategy ddp, zero1, zero2 or zero3 (the "
                         f"offload engine on every rank, each with its own tiers), got --strategy {pcfg.strategy}")
    return plan
