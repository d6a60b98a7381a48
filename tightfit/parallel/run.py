"""`tightfit train` on several processes: `run_distributed` is each rank's process (`launcher.launch` starts them).

Launch: `tightfit train --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]` re-executes
the same command line under torchrun's agent (launcher.py). Inside, WORLD_SIZE > 1 makes the CLI call
`run_worker`; a run started by torchrun or a scheduler that sets RANK/WORLD_SIZE/... takes the same path.

Each rank runs the one training loop (tightfit/train/loop.py) in a `GroupWorld` (world.py): the model built from
the same seed everywhere (identical weights, no broadcast), parallelised before the loop (trainee.py); its share of
each step's global batch (one data position for the run, TokenDataset.step_batches: disjoint shares as
DistributedSampler would give; tp and pp peers of a dp rank share its batches because they must see the same);
only global rank 0 prints, writes the metrics and the checkpoint, in the single-process format (weights and AdamW
moments gathered whole by state.py), so any strategy, or the one-process trainer, resumes any other.

A rank that dies: under torchrun the agent sees the exit and terminates the other workers within its monitor
interval (`--monitor-interval 1`, `--max-restarts 0`). Without torchrun, gloo raises in the survivors as soon as
the dead peer's socket closes, and a hung peer is bounded by the process-group timeout (`--dist-timeout`, 120 s);
`run_distributed` turns either into one line naming this rank, the collective it was waiting in (world.py's
`collective` labels each phase: setup, a training step, an evaluation, a checkpoint gather, the --max-time vote)
and why (no answer within the timeout, or the peer's connection closed), and exits with status 1.

The end of a run (`run_distributed`, `run_worker`): a final barrier, the process group destroyed once, then the
process ends with `os._exit` after flushing its output, on success and on error alike, because torch keeps gloo's
threads alive past `destroy_process_group` and tearing them down with the interpreter can abort a finished run
([Note: leaving the process group] in mesh.py).

Any split: every collective phase runs the same number of collective calls on every rank, whatever the number of
batches each rank is dealt (evaluation pads a rank's share with uncounted passes: trainee.py).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from tightfit.errors import UsageError
from tightfit.parallel.launcher import LOCK_HELD_ENV, report_failure
from tightfit.parallel.mesh import init_distributed, leave_process, shutdown
from tightfit.parallel.plan import ParallelPlan, plan_from_config
from tightfit.parallel.world import GroupWorld, set_phase, where
from tightfit.train.loop import run
from tightfit.train.signals import GracefulStop


def lost_contact_message(rank: int, where: str, error: BaseException, timeout_s: float) -> str:
    """One line: this rank, the collective it stopped waiting in, and why."""
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else type(error).__name__
    lowered = f"{type(error).__name__} {text}".lower()
    if "timed out" in lowered or "timeout" in lowered:
        why = f"no answer from the other ranks within --dist-timeout {timeout_s:g}s"
    else:
        why = "another rank's connection closed (it died or was killed)"
    return f"rank {rank}: lost contact with another rank in {where}: {why} ({first}); stopping"


def _lock_out_dir(cfg, env):
    """Rank 0 locks --out-dir unless its launcher holds the lock; every rank learns whether that failed (one
    all-reduce), so a refused run stops everywhere at once instead of leaving the others in a collective."""
    from tightfit.utils.run_lock import RunLock

    lock, refusal = None, None
    held = os.environ.get(LOCK_HELD_ENV) == str(Path(cfg.train.out_dir).resolve())
    if env.rank == 0 and not held:
        try:
            lock = RunLock.acquire(cfg.train.out_dir, "--out-dir")
        except UsageError as e:
            refusal = e
    if GroupWorld(env).any_rank(refusal is not None, "the --out-dir lock check"):
        raise refusal or UsageError(f"--out-dir: rank 0 could not lock {cfg.train.out_dir}; see its error")
    return lock


def _said(planned: tuple[ParallelPlan, str | None], log) -> ParallelPlan:
    """The plan of a (plan, why) pair, its line logged where there is one."""
    plan, why = planned
    if why is not None:
        log(f"tightfit: {why}")
    return plan


def resolve_plan(cfg, world_size: int, model: torch.nn.Module, log) -> ParallelPlan:
    """The plan for this run: `--strategy` as given, or `auto` decided by choose_strategy for this world; with
    `--offload auto`, FSDP2's CPU offload for the ZeRO-3 units that do not fit a GPU alone (unit_split.py)."""
    from dataclasses import replace

    from tightfit.parallel.auto import choose_strategy
    from tightfit.parallel.costs import Hardware, ModelProfile
    from tightfit.parallel.unit_split import split_offload, split_units
    from tightfit.utils.sizes import parse_size

    cuda = torch.cuda.is_available()
    mixed = cfg.train.precision in ("bf16", "fp16") or cfg.train.precision == "auto" and cuda  # auto: fp32 on a CPU
    recompute = cfg.memory.checkpointing == "on" or cfg.memory.checkpointing == "auto" and cuda
    if cfg.parallel.strategy != "auto":
        plan = plan_from_config(cfg.parallel, world_size, cfg.memory.offload)
        if cfg.memory.offload != "auto":
            return plan
        from tightfit.parallel.activation_checkpoint import gpu_memory

        # a rank's GPU; on CPU ranks the device is the CPU, with --gpu-mem as its budget (as in one process)
        budget = gpu_memory(cfg, torch.device("cuda", 0)) if cuda else \
            parse_size(cfg.memory.gpu_mem, "--gpu-mem") if cfg.memory.gpu_mem else None
        prof = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, mixed)
        return _said(split_units(plan, model, prof, budget, recompute), log)

    if cfg.memory.gpu_mem:
        mem = parse_size(cfg.memory.gpu_mem, "--gpu-mem")
    elif cuda:
        mem = torch.cuda.get_device_properties(0).total_memory
    else:  # CPU ranks share the host's memory
        import psutil

        mem = psutil.virtual_memory().available // max(1, cfg.parallel.nproc_per_node)
    link = cfg.parallel.interconnect
    if link == "auto":
        link = "pcie" if cfg.parallel.nnodes == 1 else "ethernet"
    hw = Hardware(gpus_per_node=world_size // cfg.parallel.nnodes, nnodes=cfg.parallel.nnodes, gpu_mem=mem,
                  interconnect=link)
    prof = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, mixed)
    choice = choose_strategy(hw, prof, log=log)
    if choice.plan is None:  # pragma: no cover - world_size > 1 always yields a plan
        raise UsageError("--strategy auto chose a single-GPU strategy for a distributed run")
    plan = choice.plan
    if cfg.memory.offload == "auto":
        plan = _said(split_offload(plan, model, prof, mem, recompute), log)
    return replace(plan, pp_schedule=cfg.parallel.pp_schedule,
                   pp_microbatches=max(cfg.parallel.pp_microbatches, plan.pp_microbatches))


def run_worker(cfg) -> NoReturn:
    """A rank's whole process under `tightfit train` (WORLD_SIZE > 1): run, report, leave.

    Every way out ends in `leave_process` ([Note: leaving the process group], mesh.py), after `run_distributed`
    has destroyed the process group: status 0 after a run (also one a stop signal ended at a step, with its
    checkpoint: the launcher exits with the signal's code, [Note: signals under torchrun]), 2 with one line for bad
    input, 130 when interrupted at once, 1 with the traceback for a bug (a lost peer already left with 1 inside
    `run_distributed`)."""
    code, line = 0, None
    try:
        run_distributed(cfg)
    except UsageError as e:
        code = e.exit_code
        if not getattr(e, "quiet", False):  # one a collective decision raised on every rank: rank 0 says it
            line = str(e)
    except KeyboardInterrupt:
        print("tightfit: interrupted", file=sys.stderr)
        code = 130
    except BaseException:  # a bug: its traceback, then the same way out
        traceback.print_exc()
        code = 1
    if not report_failure(code, line) and line:  # no launcher of ours to say it once: say it here
        print(f"tightfit: error: {line}", file=sys.stderr)
    leave_process(code)


def run_distributed(cfg, timeout_s: float | None = None) -> dict:
    """One rank of a distributed `tightfit train`. Returns a summary dict (the same on every rank).

    The end, in order: every rank's last collective is the final barrier (no rank leaves while a peer still
    exchanges data with it); rank 0's checkpoint is committed and its writer thread joined before that
    (`_save`); rank 0 releases the --out-dir lock; every rank destroys the process group, once. On an error the
    barrier is skipped (a peer may never reach it) but the group is destroyed the same way. A lost peer is the
    exception: the group is broken, so the rank says so in one line and leaves at once (`leave_process(1)`)."""
    timeout_s = cfg.parallel.dist_timeout if timeout_s is None else timeout_s
    set_phase("setup (process group and device mesh)")
    env = init_distributed(timeout_s=timeout_s, device=cfg.train.device)
    lock = None
    try:
        lock = _lock_out_dir(cfg, env)
        # A stop signal ends the run at the end of a step, with a checkpoint, on every rank at the same step: the
        # ranks vote after each step (signals.py; the launcher forwards the signal to every rank).
        with GracefulStop(save=cfg.train.save_on_signal, announce=env.rank == 0) as stopper:
            world = GroupWorld(env)
            summary = run(cfg, world, stopper=stopper)
        world.barrier("the final barrier before leaving the process group")
        return summary
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, UsageError) or not _is_comm_failure(e):
            raise
        print(f"tightfit: error: {lost_contact_message(env.rank, where(), e, timeout_s)}", file=sys.stderr,
              flush=True)
        report_failure(1)  # said here, at once: the launcher has no line of this rank to repeat
        leave_process(1)  # the process group is broken: destroying it could block on the dead peer
    finally:
        if lock is not None:
            lock.release()
        shutdown()


def _is_comm_failure(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, dist.DistError) or any(
        k in text for k in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe"))
