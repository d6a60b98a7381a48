"""`tightfit train` on several processes: `run_distributed` is each rank's loop (`launcher.launch` starts them).

Launch: `tightfit train --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]` re-executes
the same command line under torchrun's agent (launcher.py). Inside, WORLD_SIZE > 1 makes the CLI call
`run_distributed`; a run started by torchrun or a scheduler that sets RANK/WORLD_SIZE/... takes the same path.

Each rank:
- builds the model from the same seed (identical weights everywhere, so no broadcast is needed) and parallelises
  it (parallelize.py);
- draws its own batches: the data generator is seeded with its *dp* rank (tightfit.train.data.data_generator),
  which gives disjoint reproducible shards of the sample stream as DistributedSampler would; tp and pp peers of a
  dp rank share its stream because they must see the same batch;
- only global rank 0 prints and writes the checkpoint, in the single-process format (weights and AdamW moments
  gathered whole by state.py), so any strategy — or the one-process trainer — resumes any other.

A rank that dies: under torchrun the agent sees the exit and terminates the other workers within its monitor
interval (`--monitor-interval 1`, `--max-restarts 0`). Without torchrun, gloo raises in the survivors as soon as
the dead peer's socket closes, and a hung peer is bounded by the process-group timeout (`--dist-timeout`, 120 s);
`run_distributed` turns either into one line naming this rank, the collective it was waiting in (`collective`
labels each phase: setup, a training step, an evaluation, a checkpoint gather, the --max-time vote) and why (no
answer within the timeout, or the peer's connection closed), and exits with status 1.

The end of a run (`run_distributed`, `run_worker`): a final barrier, the process group destroyed once, then the
process ends with `os._exit` after flushing its output, on success and on error alike, because torch keeps gloo's
threads alive past `destroy_process_group` and tearing them down with the interpreter can abort a finished run
([Note: leaving the process group] in mesh.py).

Any split: every collective phase runs the same number of collective calls on every rank, whatever the number of
batches each rank is dealt (evaluation pads a rank's share with uncounted passes; see `evaluate`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from tightfit.errors import UsageError
from tightfit.train.divergence import describe_key, diverged
from tightfit.train.health import RunHealth
from tightfit.train.retention import Retention
from tightfit.train.signals import GracefulStop
from tightfit.parallel.launcher import LOCK_HELD_ENV, report_failure
from tightfit.parallel.mesh import build_mesh, init_distributed, leave_process, shutdown
from tightfit.parallel.parallelize import make_optimizer, parallelize
from tightfit.parallel.plan import ParallelPlan, plan_from_config


class RankLostError(RuntimeError):
    """A collective failed because another rank died, hung past the timeout, or the network broke."""


_WHERE = ["setup (process group and device mesh)"]
"""The collective phase this rank is in. Invariant: left as it is when a phase raises, so the failure report
(`run_distributed`) names the phase the rank stopped waiting in."""


@contextmanager
def collective(what: str):
    """Label the collective calls made inside the block (for the one-line report when a peer is lost)."""
    _WHERE[0] = what
    yield
    _WHERE[0] = "between collectives"


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
    if _any_rank(refusal is not None, "the --out-dir lock check"):
        raise refusal or UsageError(f"--out-dir: rank 0 could not lock {cfg.train.out_dir}; see its error")
    return lock


def resolve_plan(cfg, world_size: int, model: torch.nn.Module, log) -> ParallelPlan:
    """The plan for this run: `--strategy` as given, or `auto` decided by choose_strategy for this world."""
    from dataclasses import replace

    if cfg.parallel.strategy != "auto":
        return plan_from_config(cfg.parallel, world_size, cfg.memory.offload)
    from tightfit.parallel.auto import choose_strategy
    from tightfit.parallel.costs import Hardware, ModelProfile
    from tightfit.utils.sizes import parse_size

    if cfg.memory.gpu_mem:
        mem = parse_size(cfg.memory.gpu_mem, "--gpu-mem")
    elif torch.cuda.is_available():
        mem = torch.cuda.get_device_properties(0).total_memory
    else:  # CPU ranks share the host's memory
        import psutil

        mem = psutil.virtual_memory().available // max(1, cfg.parallel.nproc_per_node)
    link = cfg.parallel.interconnect
    if link == "auto":
        link = "pcie" if cfg.parallel.nnodes == 1 else "ethernet"
    hw = Hardware(gpus_per_node=world_size // cfg.parallel.nnodes, nnodes=cfg.parallel.nnodes, gpu_mem=mem,
                  interconnect=link)
    prof = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, cfg.train.precision != "fp32")
    choice = choose_strategy(hw, prof, log=log)
    if choice.plan is None:  # pragma: no cover - world_size > 1 always yields a plan
        raise UsageError("--strategy auto chose a single-GPU strategy for a distributed run")
    return replace(choice.plan, pp_schedule=cfg.parallel.pp_schedule,
                   pp_microbatches=max(cfg.parallel.pp_microbatches, choice.plan.pp_microbatches))


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
    _WHERE[0] = "setup (process group and device mesh)"
    env = init_distributed(timeout_s=timeout_s, device=cfg.train.device)
    lock = None
    try:
        lock = _lock_out_dir(cfg, env)
        # A stop signal ends the run at the end of a step, with a checkpoint, on every rank at the same step: the
        # ranks vote after each step (signals.py; the launcher forwards the signal to every rank).
        with GracefulStop(save=cfg.train.save_on_signal, announce=env.rank == 0) as stopper:
            summary = _train(cfg, env, stopper)
        with collective("the final barrier before leaving the process group"):
            dist.barrier()
        return summary
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, UsageError) or not _is_comm_failure(e):
            raise
        print(f"tightfit: error: {lost_contact_message(env.rank, _WHERE[0], e, timeout_s)}", file=sys.stderr,
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


def _train(cfg, env, stopper: GracefulStop | None = None) -> dict:
    from tightfit.models.build import build_model
    from tightfit.models.tokenizer import get_tokenizer
    from tightfit.train import checkpoint as ckpt
    from tightfit.train.data import data_generator
    from tightfit.train.loop import load_dataset, lr_at, resolve_precision
    from tightfit.train.progress import Progress

    t, o = cfg.train, cfg.optim
    if t.threads:
        torch.set_num_threads(t.threads)
    say = print if env.rank == 0 else (lambda *a, **k: None)
    out_dir = Path(t.out_dir)
    ckpt_path = out_dir / ckpt.CHECKPOINT_NAME
    if not t.resume and ckpt_path.exists():
        raise UsageError(f"--out-dir: {out_dir} already holds a checkpoint; pass --resume to continue it, "
                         "or choose another --out-dir")
    if t.export_hf and not cfg.model.model.startswith("hf:"):
        raise UsageError("--export-hf: only Hugging Face models (--model hf:PATH) can be exported in that layout; "
                         "the reference GPT's weights are in the checkpoint")
    tokenizer = get_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else None
    dataset = load_dataset(cfg, tokenizer, say=lambda s: say(s, flush=True))
    torch.manual_seed(t.seed)  # same seed on every rank: identical initial weights
    model = build_model(cfg.model, vocab_size=dataset.vocab_size, block_size=t.seq_len)
    start_step = 0
    resume = ckpt.load_checkpoint(ckpt_path, step=t.resume_step) if t.resume and ckpt_path.exists() else None
    if t.resume and resume is None:
        raise UsageError(f"--resume: no checkpoint in {out_dir}; drop --resume to start fresh")
    if resume is not None:
        # Weights are restored before sharding and moments after (load_moments), so every strategy resumes the
        # same way from the same full-tensor checkpoint.
        ckpt.check_compatible(resume, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(resume.get(f"model.{n}"))
        start_step = resume.step

    plan = resolve_plan(cfg, env.world_size, model, say)
    mesh = build_mesh(plan.dims, env.device)
    pm = parallelize(model, plan, mesh, env.device)
    opt = make_optimizer(pm, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2))
    if resume is not None:
        from tightfit.parallel.state import load_moments

        n = load_moments(pm, opt, resume.get)  # sliced locally from the full tensors, placed like the parameters
        say(f"resumed from {ckpt_path} at step {start_step}" + ("" if n else " (no optimizer moments in it)"))
    dtype = resolve_precision(cfg, env.device)
    autocast = (lambda: torch.autocast(env.device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext
    dp_rank = mesh["dp"].get_local_rank()
    gen = data_generator(t.seed, rank=dp_rank)
    per_rank = t.micro_batch * t.grad_accum  # sequences per dp rank per step

    def draw_step() -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's batches for one step: one per-rank batch for a pipeline (the schedule splits it),
        else --grad-accum micro-batches."""
        if plan.dims.pp > 1:
            return [dataset.sample(per_rank, gen)]
        return [dataset.sample(t.micro_batch, gen) for _ in range(t.grad_accum)]

    if resume is not None:
        # The checkpoint holds rank 0's data position (what a one-process run saves too). Other dp ranks replay
        # their own stream up to the resumed step: exact when the layout and batch flags are unchanged.
        if dp_rank == 0:
            ckpt.restore_rng(resume.rng_states(), gen)
        else:
            for _ in range(start_step):
                draw_step()
    global_batch = per_rank * plan.dims.dp
    n_params = sum(p.numel() for p in model.parameters())
    say(f"tightfit: {env.world_size} ranks, mesh {plan.dims}, strategy {plan.name}"
        f"{f' ({plan.pp_schedule}, {plan.pp_microbatches} micro-batches)' if plan.dims.pp > 1 else ''}; "
        f"{n_params:,} parameters, {global_batch} sequences x {t.seq_len} tokens per step", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    # Rank 0 reports with the single-process trainer's Progress (same lines, same metrics.jsonl records).
    progress = Progress(t.steps, start_step, global_batch * t.seq_len, out_dir / "metrics.jsonl",
                        lambda: _memory(env.device), enabled=env.rank == 0)
    # Validation: the trainer's fixed held-out batches, dealt round-robin to the dp ranks (pipeline runs draw
    # them at the per-rank batch size, which the schedule can split into micro-batches).
    val = dataset.val_batches(t.eval_batches, per_rank if plan.dims.pp > 1 else t.micro_batch, seed=t.seed + 1)
    mine = val[dp_rank::plan.dims.dp]
    # Invariant: every rank runs the same number of forward passes (ceil(batches / dp)), whatever the split: a
    # forward is collective under zero3 (all-gathers), tp and pp. A rank dealt fewer batches runs its missing
    # passes on val[0] and does not count them (weight 0), so the mean is over the real batches only.
    rounds = -(-len(val) // plan.dims.dp)

    def evaluate(at: int) -> float:
        with collective(f"evaluation at step {at}"):
            total = 0.0
            for i in range(rounds):
                x, y = mine[i] if i < len(mine) else val[0]
                loss = pm.eval_loss(x.to(env.device), y.to(env.device))
                total += float(loss) if i < len(mine) else 0.0
            return pm.global_loss(total / max(1, len(mine)), weight=len(mine))

    step, loss, val_loss, t0 = start_step, float("nan"), float("nan"), time.perf_counter()
    signalled = 0  # the signal that stopped the run, agreed by every rank
    # Every rank follows the run's health (the loss is global); rank 0 writes the verdicts and keeps the checkpoints.
    health = RunHealth.resumed(resume.health if resume is not None else None)
    retention = Retention(ckpt_path, t.keep_checkpoints, health, start_step, say)
    while step < t.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        batches = draw_step()
        with collective(f"training step {step + 1} (forward, backward, gradient reduction, loss all-reduce)"):
            parts = []
            for i, (x, y) in enumerate(batches):  # gradients reduced over dp once, in the last backward
                with autocast():
                    parts.append(pm.forward_backward(x.to(env.device), y.to(env.device), 1.0 / len(batches),
                                                     sync=i == len(batches) - 1))
            local = torch.stack(parts).mean()
            norm = pm.clip_grad_norm_(o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = pm.global_loss(local)
        step += 1
        notice = health.observe(step, loss, norm if math.isfinite(loss) else None, lr_at(step - 1, cfg))
        if notice:
            say(notice, flush=True)
        if env.rank == 0:
            retention.judge()  # the verdict of the checkpoint before this step
        if not math.isfinite(loss):  # the same on every rank: rank 0 says it
            error = diverged(step, f"the loss became {loss}", root=ckpt_path, lr=lr_at(step - 1, cfg),
                             spike=health.first_spike, optim=o)
            raise error if env.rank == 0 else quiet(error)
        if step % t.log_interval == 0 or step == t.steps:
            progress.step(step, loss, opt.param_groups[0]["lr"], norm)
        if step % t.eval_interval == 0 or step == t.steps:
            val_loss = evaluate(step)  # collective: every rank evaluates
            progress.eval(step, val_loss)
        if t.save_interval and step % t.save_interval == 0 and step < t.steps:
            _save(pm, opt, env, ckpt_path, step, cfg, gen, health, retention)
        stop = ""
        if t.stop_at and t.stop_at <= step < t.steps:
            stop = f"--stop-at {t.stop_at} reached"
        elif t.max_time or step < t.steps:  # one vote for both: clocks differ and a signal may reach one rank
            late, signum = _max_ranks([int(bool(t.max_time) and time.perf_counter() - t0 > t.max_time),
                                       (stopper.signum or 0) if stopper and step < t.steps else 0],
                                      f"the stop vote (--max-time, signals) after step {step}")
            if late:
                stop = f"--max-time {t.max_time:g}s reached at step {step}"
            elif signum:
                signalled = signum
                stop = f"{signal.Signals(signum).name} received; stopped at step {step}"
        if stop:
            say(f"{stop}; continue with --resume" if not signalled or t.save_on_signal else
                f"{stop} without a checkpoint of it (--no-save-on-signal); --resume continues from the last one "
                "saved", flush=True)
            if step % t.eval_interval:
                val_loss = evaluate(step)
                progress.eval(step, val_loss)
            break
    path, full = (None, None) if signalled and not t.save_on_signal else _save(pm, opt, env, ckpt_path, step, cfg,
                                                                                gen, health, retention)
    if env.rank == 0:
        retention.judge(final=True)
    seconds = time.perf_counter() - t0
    if t.export_hf and env.rank == 0:
        from tightfit.models.hf_save import save_hf_model
        from tightfit.train.loop import build_meta_model

        # A meta-device twin plans the files (shapes, dtypes, tied names); the gathered tensors are the values.
        save_hf_model(build_meta_model(cfg), t.export_hf, tensors=full.items(), strip_prefix="model.")
        say(f"exported the model in the Hugging Face layout to {t.export_hf}")
    if t.export_hf:
        with collective("the barrier after rank 0 exported the Hugging Face folder"):
            dist.barrier()
    summary = {"steps": step - start_step, "final_step": step, "train_loss": loss, "val_loss": val_loss,
               "seconds": seconds, "strategy": plan.name, "mesh": list(plan.dims.shape()),
               "stopped_by": signal.Signals(signalled).name if signalled else None}
    progress.log({"kind": "summary", **summary})
    say(f"done: {step - start_step} steps in {seconds:.1f}s, train loss {loss:.4f}, val loss {val_loss:.4f} "
        f"nats/token; checkpoint {path}", flush=True)
    return summary


def _memory(device: torch.device) -> dict[str, int]:
    """Rank 0's memory for the progress line: allocated device memory on CUDA, the process's RSS on CPU."""
    if device.type == "cuda":
        return {"device": torch.cuda.memory_allocated(device)}
    import psutil

    return {"rss": psutil.Process().memory_info().rss}


def quiet(error: UsageError) -> UsageError:
    """`error`, marked as one every rank raised alike, which only rank 0 prints (`run_worker`)."""
    error.quiet = True
    return error


def _any_rank(flag: bool, what: str) -> bool:
    """True on every rank if it is true on any (one tiny all-reduce): a decision all ranks must take together."""
    return bool(_max_ranks([1 if flag else 0], what)[0])


def _max_ranks(values: list[int], what: str) -> list[int]:
    """The largest of every rank's value at each position (one tiny all-reduce), the same on every rank."""
    t = torch.tensor([float(v) for v in values])
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        t = t.cuda()
    with collective(what):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def _save(pm, opt, env, path: Path, step: int, cfg, gen, health, retention) -> tuple[Path | None, dict | None]:
    """Gather weights and AdamW moments on rank 0 and write the single-process checkpoint format, so any strategy,
    world size, or the one-process trainer can resume it (state.py), with the run's health (health.py); rank 0
    keeps what retention keeps (retention.py). Returns (path, full state) on rank 0."""
    from tightfit.parallel.state import gather_full_state
    from tightfit.train import checkpoint as ckpt
    from tightfit.train.loop import lr_at

    with collective(f"the checkpoint gather at step {step}"):
        full = gather_full_state(pm, opt)  # collective; None off rank 0
    out, failed = None, None
    if env.rank == 0:
        shapes = [(k[len("model."):], tuple(t.shape)) for k, t in full.items() if k.startswith("model.")]
        try:
            out = ckpt.save_checkpoint(path, sorted(full.items()), step=step, config=cfg.to_dict(),
                                       signature=ckpt.model_signature(shapes), rng=ckpt.capture_rng(gen),
                                       keep=cfg.train.keep_checkpoints, health=health.record(step))
            retention.committed(step, out)
        except UsageError as e:  # every rank must learn it, or they would wait for rank 0 at the next collective
            failed = e
    # The vote is the barrier after rank 0's write: no rank goes on before it is done, and all stop if it failed.
    if not _any_rank(failed is not None, f"the barrier after rank 0 wrote the checkpoint of step {step}"):
        return out, full
    if isinstance(failed, ckpt.NonFiniteSaved):
        retention.judge()
        nf = failed.non_finite
        raise diverged(step, f"{describe_key(nf.key)} became {nf.what}", root=path, lr=lr_at(step - 1, cfg),
                       spike=health.first_spike, optim=cfg.optim)
    raise failed if failed is not None else quiet(UsageError(f"rank {env.rank}: stopping: rank 0 could not save "
                                                             f"the checkpoint of step {step}"))
