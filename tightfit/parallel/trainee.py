"""What the training loop trains on a rank of a process group: this rank's part of the parallelised model.

The parallel transform, applied before the loop (as torchtitan applies its parallelisms before its train loop):
the strategy (`resolve_plan`: `--strategy` as given, or chosen for this world), the device mesh, `parallelize`
(PP split, TP, DP, the PP schedule) and the optimizer; a resumed checkpoint's weights go in before sharding and its
moments after (`load_moments`), so every strategy resumes the same full-tensor checkpoint. `Sharded` then answers
the loop's calls as the one-process trainee does (tightfit/train/trainee.py), each reduction over the group:
- the loss every rank agrees on: `ParallelModel.global_loss`, one all-reduce;
- evaluation: the held-out batches dealt round-robin to the data ranks. Invariant: every rank runs the same number
  of forward passes (ceil(batches / dp)), whatever the split: a forward is collective under zero3 (all-gathers),
  tp and pp. A rank dealt fewer batches runs its missing passes on the first batch and does not count them;
- a checkpoint: every weight and AdamW moment gathered whole on rank 0, in the one-process format (state.py), so
  any strategy, world size, or the one-process trainer resumes it.
"""

from __future__ import annotations

from typing import Callable

import torch

from tightfit.errors import UsageError
from tightfit.utils.sizes import format_size, parse_size
from tightfit.train.trainee import NonFiniteWeight, autocast_for


class Sharded:
    """This rank's `pm` (ParallelModel) and `optimizer`, in `world` (GroupWorld)."""

    scaler = None  # fp16's loss scaler is the one-process trainer's (a CUDA device of its own)
    takes_examples = False  # fine-tuning batches: one process, or ddp with the offload engine (replicas.py)
    plan = None  # no memory plan: the strategy is the plan (`summary_fields`)

    def __init__(self, pm, optimizer, world, device: torch.device, dtype: torch.dtype,
                 shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        self.pm, self.optimizer, self.world, self.device, self.dtype = pm, optimizer, world, device, dtype
        self.swap: tuple | None = None  # (this rank's swap folder, whether tightfit made it): shard()'s
        self.predicted_device: int | None = None  # a GPU rank's device bytes by costs.memory_per_gpu: shard()'s
        self.step_early = False  # the optimizer steps each unit during the last backward (shard_states.py; no clip)
        self.model = pm.module
        self.shapes = shapes  # the whole model's (name, shape), before sharding: the checkpoint's signature
        self.autocast = autocast_for(device, dtype)
        self.data_rank = pm.mesh["dp"].get_local_rank()
        self.data_ranks = pm.plan.dims.dp
        self.whole_batch = pm.plan.dims.pp > 1  # the schedule splits one batch into its micro-batches

    def describe(self) -> str:
        plan = self.pm.plan
        schedule = f" ({plan.pp_schedule}, {plan.pp_microbatches} micro-batches)" if plan.dims.pp > 1 else ""
        return f"tightfit: {self.world.size} ranks, mesh {plan.dims}, strategy {plan.name}{schedule}"

    def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        parts = []
        for i, (x, y) in enumerate(batches):  # gradients reduced over dp once, in the last backward
            if i == len(batches) - 1 and self.step_early:  # no clip: each unit steps as its gradients arrive
                self.optimizer.step_during_backward()
            with self.autocast():
                parts.append(self.pm.forward_backward(x.to(self.device), y.to(self.device), 1.0 / len(batches),
                                                      sync=i == len(batches) - 1))
        return torch.stack(parts).mean()

    def clip_and_step(self, max_norm: float) -> float:
        norm = self.pm.clip_grad_norm_(max_norm)  # the global norm, over every shard on every rank
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def global_loss(self, local: torch.Tensor) -> float:
        return self.pm.global_loss(local)

    def evaluate(self, batches) -> float:
        dp = self.data_ranks
        mine = batches[self.data_rank::dp]
        total = 0.0
        for i in range(-(-len(batches) // dp)):
            x, y = mine[i] if i < len(mine) else batches[0]
            loss = self.pm.eval_loss(x.to(self.device), y.to(self.device))
            total += float(loss) if i < len(mine) else 0.0
        return self.pm.global_loss(total / max(1, len(mine)), weight=len(mine))

    def signature_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.shapes

    def _gather(self) -> dict[str, torch.Tensor] | None:
        from tightfit.parallel.state import gather_full_state

        return gather_full_state(self.pm, self.optimizer)  # collective; None off rank 0

    def checkpoint_groups(self, hand_over: bool = False):
        from tightfit.train.checkpoint import group_by_key

        full = self._gather()
        return None if full is None else group_by_key(sorted(full.items()))

    def export_hf(self, folder: str, meta_model: Callable[[], torch.nn.Module], check_finite: bool = False,
                  merge_lora: bool = False) -> None:
        """The gathered weights written by rank 0, a meta-device twin planning the files (shapes, dtypes, tied
        names); every rank learns whether rank 0's write failed (one vote), so none waits for it."""
        from tightfit.models.hf_save import save_hf_model
        from tightfit.train.checkpoint_writer import non_finite_in

        full, failed = self._gather(), None
        if full is not None:
            try:
                weights = {k: v for k, v in full.items() if k.startswith("model.")}
                for key, t in weights.items():
                    bad = non_finite_in(t) if check_finite else None
                    if bad:
                        raise NonFiniteWeight(key, bad)
                save_hf_model(meta_model(), folder, tensors=weights.items(), strip_prefix="model.")
            except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
                failed = e
        if self.world.any_rank(failed is not None, "the vote after rank 0 exported the Hugging Face folder"):
            raise failed if failed is not None else self.world.raised_everywhere(
                UsageError(f"rank {self.world.rank}: stopping: rank 0 could not export the Hugging Face folder"))

    def memory_in_use(self) -> dict[str, int]:
        """This rank's memory: allocated device memory on CUDA, the process's RSS on a CPU."""
        if self.device.type == "cuda":
            return {"device": torch.cuda.memory_allocated(self.device)}
        import psutil

        return {"rss": psutil.Process().memory_info().rss}

    def peak_memory(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {"device": torch.cuda.max_memory_allocated(self.device)}
        from tightfit.train.memory import _rss_high_water

        return {"rss": _rss_high_water()}

    def engine_counters(self):
        """The optimizer's seconds and disk bytes where it keeps the shards' moments itself (shard_states.py)."""
        counters = getattr(self.optimizer, "counters", None)
        return counters() if counters is not None else None

    def compare_with_plan(self, step_seconds: float) -> str | None:
        """On a GPU rank: the device peak `costs.memory_per_gpu` predicted for this strategy (the figure the split of
        unit_split.py and the checkpointing were decided by) against CUDA's allocated peak; None on a CPU rank."""
        record = self.plan_record(step_seconds, None)
        if record is None:
            return None
        p, m = record["predicted"]["device_peak"], record["measured"]["device_peak"]
        return (f"plan (rank {self.world.rank}): device peak {format_size(p)} predicted, {format_size(m)} measured "
                f"({(p - m) / max(m, 1):+.0%})")

    def plan_record(self, step_seconds: float, run_seconds_per_step: float | None) -> dict | None:
        if self.predicted_device is None or self.device.type != "cuda":
            return None
        return {"predicted": {"device_peak": self.predicted_device},
                "measured": {"device_peak": torch.cuda.max_memory_allocated(self.device), "step_s": step_seconds},
                "run_seconds_per_step": run_seconds_per_step}

    def summary_fields(self) -> dict:
        return {"strategy": self.pm.plan.name, "mesh": list(self.pm.plan.dims.shape()), "ranks": self.world.size}

    def close(self) -> None:
        """The optimizer's thread and swap files (shard_states.py), and the rank's swap folder if tightfit made it;
        the process group is the caller's (run.py)."""
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()
        if self.swap is not None:
            from tightfit.parallel.replicas import remove_rank_folder

            remove_rank_folder(*self.swap)


def shard(model: torch.nn.Module, cfg, world, plan, dtype: torch.dtype, resume, say: Callable[[str], None]) -> Sharded:
    """The parallel transform of `model` (built alike on every rank) for this rank, with `resume`'s state in it."""
    from tightfit.parallel.activation_checkpoint import gpu_memory, wanted
    from tightfit.parallel.costs import ModelProfile
    from tightfit.parallel.mesh import build_mesh
    from tightfit.parallel.parallelize import make_optimizer, parallelize
    from tightfit.parallel.state import load_moments

    o = cfg.optim
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if resume is not None:  # weights before sharding, moments after: every strategy resumes alike
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(resume.get(f"model.{n}"))
    device = world.env.device
    if device.type == "cuda" and cfg.memory.gpu_mem:  # a rank's budget is its cap, as one process's (memory.py)
        from tightfit.train.memory import cap_device_memory

        cap_device_memory(device, parse_size(cfg.memory.gpu_mem, "--gpu-mem"))
    profile = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, dtype != torch.float32)
    recompute, why = wanted(cfg.memory.checkpointing, plan, profile, gpu_memory(cfg, device))
    pm = parallelize(model, plan, build_mesh(plan.dims, device), device, checkpoint=recompute,
                     param_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)
    if recompute:
        say(f"activation checkpointing: every block recomputes its forward in backward ({why})")
    swap, made, room = None, False, None
    if plan.cpu_offload and cfg.memory.nvme:  # FSDP2's CPU offload: moments past the rank's host room on its NVMe
        from tightfit.parallel.rank_plan import rank_config
        from tightfit.parallel.replicas import make_rank_folder

        mine, swap = rank_config(cfg, world.rank)
        made = make_rank_folder(swap)
        # the rank's host budget less what else is there: FSDP2's fp32 parameter and gradient shards of the
        # offloaded units (every unit's on a CPU, whose device is the host), and on a CPU the kept units' moments
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()]
        on_host = sum(t.numel() for t in local if t.device.type == "cpu")
        kept_moments = sum(n for _, n in plan.kept_on_device) if device.type != "cuda" else 0
        shards = 8 * (on_host + kept_moments)
        room = max(0, parse_size(mine.memory.cpu_mem, "--cpu-mem") - shards)
    optimizer = make_optimizer(pm, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2),
                               moments_folder=swap, host_room=room)
    if swap is not None:
        on_disk = [u for u in optimizer.units if u.on_disk]
        kept = [u for u in optimizer.units if u.resident]
        say(f"AdamW's moments: {len(kept)} of {len(optimizer.units)} units on the device, " * bool(kept) +
            f"{len(optimizer.units) - len(on_disk) - len(kept)} of {len(optimizer.units)} units in host memory, "
            f"{len(on_disk)} ({format_size(sum(u.moment_bytes for u in on_disk))}) in {swap}, each unit stepped "
            "under the next forward")
    if resume is not None and not load_moments(pm, optimizer, resume.get):
        say("notice: the checkpoint holds no optimizer moments; AdamW starts afresh")
    sharded = Sharded(pm, optimizer, world, device, dtype, shapes)
    sharded.swap = (swap, made) if swap is not None else None
    if device.type == "cuda" and plan.dims.pp == 1:
        from dataclasses import replace

        from tightfit.parallel.costs import memory_per_gpu

        sharded.predicted_device = memory_per_gpu(plan, replace(profile, checkpointed=recompute))["total"]
    sharded.step_early = o.grad_clip <= 0 and hasattr(optimizer, "step_during_backward")
    return sharded
