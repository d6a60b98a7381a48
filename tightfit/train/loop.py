"""The training loop behind `tightfit train`, readable top to bottom.

One step: for each of `grad_accum` micro-batches, forward under autocast and backward (loss divided by the
accumulation count); clip the global gradient norm; optimizer step; zero gradients. The same loop serves plain
PyTorch and offloaded models: what differs is which model/optimizer pair `setup_memory` hands back, not the loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tightfit.config import Config, compute_device_type, precision_name
from tightfit.errors import UsageError
from tightfit.offload.step.loss_scale import load_scaler_state, scaler_state
from tightfit.train import checkpoint as ckpt
from tightfit.train.checkpoint_swap import state_groups
from tightfit.train.checkpoint_writer import check_room, checkpoint_bytes, clean_leftovers, committed
from tightfit.train.divergence import describe_key, diverged
from tightfit.train.health import SUSPECT, RunHealth, verdict_of
from tightfit.train.data import TokenDataset, data_generator, load_tokens
from tightfit.train.memory import MemorySetup, check_buildable, setup_memory
from tightfit.train.preflight import check_outputs
from tightfit.train.signals import GracefulStop
from tightfit.train.progress import EngineWindow, Progress, format_duration
from tightfit.train.retention import Retention
from tightfit.train.tensorboard import open_sink
from tightfit.utils.sizes import format_size


STEPS_TIMED = 1000
"""The last steps whose median is the measured step the plan is compared with ([Note: the step the plan predicts])."""


def resolve_device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(compute_device_type(cfg, torch.cuda.is_available()))


def resolve_precision(cfg: Config, device: torch.device) -> torch.dtype:
    name = precision_name(cfg, device.type)
    if name == "fp16" and device.type != "cuda":
        raise UsageError("--precision: fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr at --steps. `step` counts from 0."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Summary:
    """What a run did; returned by `train()` and printed at the end."""

    steps_done: int
    final_step: int
    train_loss: float
    val_loss: float
    seconds: float
    tokens_per_s: float
    checkpoint: Path | None
    peak_memory: dict[str, int] = field(default_factory=dict)
    stopped_by: str | None = None
    """The signal that stopped the run at the end of a step (SIGTERM, SIGHUP, SIGINT), if one did."""
    exit_code: int = 0
    """What `tightfit train` exits with: 128 + the signal's number after a signal, else 0."""


def load_dataset(cfg: Config, tokenizer, say=None) -> TokenDataset:
    """The corpus --data names, split; `say` gets the progress of a tokenizer's encoding (`load_tokens`)."""
    tokens = load_tokens(cfg.data.data, tokenizer, say)
    vocab = tokenizer.vocab_size if tokenizer is not None else 256
    return TokenDataset.from_tokens(tokens, cfg.train.seq_len, cfg.data.val_fraction, vocab)


def build_meta_model(cfg: Config) -> torch.nn.Module:
    """The model `cfg` names, on the meta device: shapes for planning, no memory, no weights read."""
    from tightfit.models.build import hf_path
    from tightfit.models.gpt import GPT, GPTConfig

    path = hf_path(cfg.model.model)
    if path is None:
        m = cfg.model
        with torch.device("meta"):
            return GPT(GPTConfig(vocab_size=_vocab_size(cfg), block_size=cfg.train.seq_len, n_layer=m.n_layer,
                                 n_head=m.n_head, n_embd=m.n_embd))
    from tightfit.models.build import build_model

    return build_model(cfg.model, vocab_size=_vocab_size(cfg), block_size=cfg.train.seq_len, device="meta")


def _vocab_size(cfg: Config) -> int:
    from tightfit.models.tokenizer import get_tokenizer

    return get_tokenizer(cfg.model.tokenizer).vocab_size if cfg.model.tokenizer else 256


@torch.no_grad()
def evaluate(model, batches, loss_fn, device, autocast) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast():
            total += loss_fn(model, x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / len(batches)


class NonFiniteWeight(Exception):
    """A weight an export found NaN or infinite (`key`, `what`: as the checkpoint writer says it)."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(key, what)
        self.key, self.what = key, what


def export_hf(model: torch.nn.Module, mem: MemorySetup, folder: str, check_finite: bool = False) -> None:
    """Write the trained model as a Hugging Face folder, streamed from wherever its weights live. `check_finite`:
    raise NonFiniteWeight for a NaN or infinite weight (the export is then not written): a run exports before its
    last save, which would have refused such a state."""
    from tightfit.models.hf_save import save_hf_model
    from tightfit.train.checkpoint_writer import non_finite_in

    def checked():
        for key, t in mem.export_state():
            bad = non_finite_in(t) if check_finite and key.startswith("model.") else None
            if bad:
                raise NonFiniteWeight(key, bad)
            yield key, t

    save_hf_model(model, folder, tensors=checked(), strip_prefix="model.")


def shares_disk(cfg: Config, out_dir: Path) -> bool:
    """Is the swap folder on the --out-dir's filesystem? Then its files (already allocated when the room for a
    checkpoint is checked) and the checkpoints share one disk."""
    from tightfit.config import parse_nvme
    from tightfit.offload.tiers.nvme.store import device_of

    swap = parse_nvme(cfg.memory.nvme)[0] if cfg.memory.nvme and cfg.memory.offload != "none" else None
    return swap is not None and device_of(swap) == device_of(out_dir)


def last_save_frees(cfg: Config, out_dir: Path, plan) -> int:
    """Bytes of `--out-dir`'s disk the run's last save needs less than a whole checkpoint: the swap files it
    removes as it goes ([Note: the last save takes the swap's place] in memory_model.py). 0 where the swap is on
    another disk."""
    return 0 if plan is None or not shares_disk(cfg, out_dir) else plan.last_save_takes_over()


def train(cfg: Config, *, quiet: bool = False) -> Summary:
    """Run `tightfit train` with a validated config. Raises UsageError on bad input."""
    from tightfit.utils.run_lock import RunLock

    check_outputs(cfg)  # every path the run writes, before anything runs (preflight.py)
    # One run per --out-dir (utils/run_lock.py): a second one is refused with one line naming this run's PID.
    # A stop signal ends the run at the end of a step, with a checkpoint (signals.py).
    with RunLock.acquire(cfg.train.out_dir, "--out-dir"), GracefulStop(save=cfg.train.save_on_signal) as stopper:
        return _train(cfg, quiet=quiet, stopper=stopper)


def _train(cfg: Config, *, quiet: bool, stopper: GracefulStop | None = None) -> Summary:
    from tightfit.models.build import build_model, hf_path, model_loss
    from tightfit.models.tokenizer import get_tokenizer

    t, o = cfg.train, cfg.optim
    if t.threads:
        cores = os.cpu_count() or 1
        if t.threads > cores:  # 100,000 segfaulted in OpenMP; thousands made a step take minutes
            if not quiet:
                print(f"notice: --threads {t.threads} is more than this machine's {cores} cores; using {cores}",
                      flush=True)
        torch.set_num_threads(min(t.threads, cores))
    device = resolve_device(cfg)
    dtype = resolve_precision(cfg, device)
    out_dir = Path(t.out_dir)
    ckpt_root = out_dir / ckpt.CHECKPOINT_NAME
    if not t.resume and ckpt.latest(out_dir) is not None:
        raise UsageError(f"--out-dir: {out_dir} already holds a checkpoint; pass --resume to continue it, "
                         "or choose another --out-dir")

    torch.manual_seed(t.seed)
    # Byte-level text takes the fast path (raw bytes are the token ids); a named tokenizer encodes the text.
    tokenizer = get_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else None
    dataset = load_dataset(cfg, tokenizer, say=None if quiet else (lambda s: print(s, flush=True)))
    # A Hugging Face model that will be offloaded is built on the meta device and its weights stream straight into
    # the planned tiers after wrapping (one unit in host memory at a time): it may be larger than RAM.
    hf_folder = hf_path(cfg.model.model)
    stream_weights = hf_folder is not None and cfg.memory.offload != "none"
    if not stream_weights:  # measured on the meta device first: one too large to build is refused, not allocated
        check_buildable(build_meta_model(cfg), cfg, device.type)
    model = build_model(cfg.model, vocab_size=dataset.vocab_size, block_size=t.seq_len,
                        device="meta" if stream_weights else "cpu")

    if t.export_hf and hf_folder is None:
        raise UsageError("--export-hf: only Hugging Face models (--model hf:PATH) can be exported in that layout; "
                         "the reference GPT's weights are in the checkpoint")
    # load_checkpoint refuses a missing, truncated or foreign file with a one-line --resume error.
    # Every tensor's name, shape and dtype is checked against this model, and the metadata, before any is loaded.
    resume_from = ckpt.load_checkpoint(out_dir, step=t.resume_step) if t.resume else None
    if resume_from is not None:
        ckpt.check_compatible(resume_from, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
        resume_from.check_rng()  # before any tier is written

    start_step = resume_from.step if resume_from is not None else 0
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    def room(plan, swap_to_come: int = 0) -> tuple[int, int, int, str]:
        """(per checkpoint, need, free, note): the checkpoints this run keeps fit `--out-dir` (check_room)."""
        per = checkpoint_bytes(shapes, trainable)
        shared = shares_disk(cfg, out_dir)
        frees = last_save_frees(cfg, out_dir, plan)
        note = ("" if not shared else "the --nvme swap files, already allocated, share this disk" if not swap_to_come
                else f"the {format_size(swap_to_come)} of --nvme swap files this plan keeps share this disk")
        if frees:
            note += f", and the last save takes {format_size(frees)} of them over"
        saves = 1 + ((t.steps - 1 - start_step) // t.save_interval if t.save_interval else 0)  # + the last
        need, free = check_room(out_dir, per, keep=t.keep_checkpoints, kept=len(committed(ckpt_root)), saves=saves,
                                note=f" ({note})" if note else "", reserved=swap_to_come if shared else 0,
                                last_frees=frees)
        return per, need, free, note

    # The checkpoints must fit beside the swap files: checked on the plan, before the engine fills them.
    early = (lambda plan: room(plan, plan.prediction.peak.get("nvme", 0))) \
        if t.keep_checkpoints and t.steps > start_step else None
    mem: MemorySetup = setup_memory(model, cfg, device, dtype, planned=early)
    pending = None  # the checkpoint being written (a CheckpointWriter), if any
    profiler = None  # --profile DIR: records a few steps (profiling.py)
    progress = None  # the status line and the metrics' sinks (progress.py)
    try:
        model, opt = mem.model, mem.optimizer
        say = (lambda s: None) if quiet else (lambda s: print(s, flush=True))
        say(mem.describe())

        gen = data_generator(t.seed)
        scaler = getattr(mem, "scaler", None)  # fp16 only: its state is part of a checkpoint
        if resume_from is not None:
            mem.import_state(resume_from.get)
            ckpt.restore_rng(resume_from.rng_states(), gen)
            load_scaler_state(scaler, resume_from.loss_scaler)
            resume_from.close()  # its shards' file handles
            say(f"resumed from {resume_from.path} at step {start_step}")
            changed = ckpt.changed_settings(resume_from.config, cfg.to_dict())
            if changed:
                say(f"notice: resuming with settings changed since the checkpoint: {', '.join(changed)}")
        elif stream_weights:
            from tightfit.models.hf_load import HFCheckpoint
            from tightfit.models.hf_wrap import checkpoint_values

            with checkpoint_values(HFCheckpoint.open(hf_folder)) as get:
                mem.import_state(get)
        if start_step == t.steps and t.export_hf:  # export what a finished run saved, without training more
            export_hf(model, mem, t.export_hf)
            say(f"exported the model of {resume_from.path} (step {start_step}) in the Hugging Face layout to "
                f"{t.export_hf}")
            summary = Summary(steps_done=0, final_step=start_step, train_loss=float("nan"), val_loss=float("nan"),
                              seconds=0.0, tokens_per_s=0.0, checkpoint=resume_from.path,
                              peak_memory=mem.peak_memory())
            mem.close()
            return summary
        if start_step >= t.steps:
            raise UsageError(f"--steps: the checkpoint is already at step {start_step}; ask for more than that (or, "
                             f"to export it, --steps {start_step} with --export-hf)")

        out_dir.mkdir(parents=True, exist_ok=True)
        removed = clean_leftovers(ckpt_root)
        if removed:
            say(f"removed what an interrupted save left in {ckpt_root}: {', '.join(removed)}")
        if t.keep_checkpoints:
            per, need, free, note = room(getattr(mem, "plan", None))  # again, now the swap files are allocated
            say(f"checkpoint: {format_size(per)} per save in {ckpt_root} ({format_size(free)} free now, keeping "
                f"{t.keep_checkpoints}: {format_size(need)} more at the peak{'; ' + note if note else ''})")
        else:
            say("checkpoint: none (--keep-checkpoints 0)")
        val_batches = dataset.val_batches(t.eval_batches, t.micro_batch, seed=t.seed + 1)
        tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum
        tensorboard = open_sink(t.tensorboard, out_dir) if not quiet else None
        progress = Progress(t.steps, start_step, tokens_per_step, out_dir / "metrics.jsonl", mem.memory_in_use,
                            enabled=not quiet, sinks=[tensorboard] if tensorboard else [])
        autocast = ((lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext)
        say(f"training {sum(p.numel() for p in model.parameters()):,} parameters on {device} ({str(dtype)[6:]}), "
            f"{len(dataset.train):,} train / {len(dataset.val):,} val tokens, {tokens_per_step:,} tokens per step")

        # The save in progress: its writer thread finishes it while training goes on (checkpoint_writer.py).
        last_good = None  # (step, folder) of the newest committed checkpoint
        if resume_from is not None:
            last_good = (resume_from.step, resume_from.path)
        # The loss around each checkpoint, and the verdicts retention and the divergence message go by (health.py).
        health = RunHealth.resumed(resume_from.health if resume_from is not None else None)
        retention = Retention(ckpt_root, t.keep_checkpoints, health, start_step, say)

        def divergence(at: int, what: str) -> UsageError:
            return diverged(at, what, root=ckpt_root, lr=lr, spike=health.first_spike, optim=o)

        def settle() -> None:
            """Wait for the save in progress; a non-finite tensor in it is the run's divergence."""
            nonlocal pending, last_good
            if pending is None:
                return
            writer, pending = pending, None
            path = writer.wait()
            if path is None:
                nf = writer.non_finite
                retention.judge()
                raise divergence(writer.step, f"{describe_key(nf.key)} became {nf.what}")
            last_good = (writer.step, path)
            retention.committed(writer.step, path)

        def save(step: int, last: bool = False) -> None:
            """`last`: the run's last save, which takes the swap files over; the engine is closed once it has
            ([Note: the last save takes the swap's place] in memory_model.py)."""
            nonlocal pending
            if not t.keep_checkpoints:
                return
            settle()  # one save at a time: its memory and disk are what the plan counted
            pending = ckpt.start_save(ckpt_root, state_groups(model, opt, hand_over=last), step=step,
                                      config=cfg.to_dict(), signature=ckpt.model_signature(mem.named_shapes()),
                                      rng=ckpt.capture_rng(gen), loss_scaler=scaler_state(scaler),
                                      health=health.record(step))
            if last:
                mem.close()

        if t.profile:
            from tightfit.train.profiling import StepProfiler

            profiler = StepProfiler(t.profile, plan=getattr(mem, "plan", None), cuda=device.type == "cuda")
        t_start = time.perf_counter()
        step, loss_val, val_loss, grad_norm, lr = start_step, float("nan"), float("nan"), None, o.lr
        # [Note: the step the plan predicts] The plan predicts one optimizer step in the steady state: the median
        # of the last STEPS_TIMED steps (their micro-batches, clip, step and the loss read back, which waits for
        # the device) is what its prediction is compared with; evaluation, saves and a first step's warm-up are not
        # steps. The run's own rate, everything included, is the summary's tokens/s.
        step_times: deque[float] = deque(maxlen=STEPS_TIMED)
        counted = EngineWindow(mem.engine_counters)  # the engine's bytes and seconds per step, for each report
        while step < t.steps:
            t_step = time.perf_counter()
            counted.begin()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            batches = [dataset.sample(t.micro_batch, gen) for _ in range(t.grad_accum)]

            def forward(x, y):
                with autocast():
                    return model_loss(model, x.to(device), y.to(device)) / t.grad_accum

            # In the plan's order (micro-batch or unit major: MemorySetup.accumulate); summed on the device: one host
            # sync a step, not one per micro-batch.
            loss_sum = torch.zeros((), device=device)
            for loss in mem.accumulate([lambda x=x, y=y: forward(x, y) for x, y in batches]):
                loss_sum += loss
            grad_norm = mem.clip_and_step(o.grad_clip)
            step += 1
            loss_val = loss_sum.item()
            step_times.append(time.perf_counter() - t_step)
            counted.end(step_times[-1])
            # An fp16 scaler skips a step whose gradients overflowed (its norm is inf then): not a divergence.
            checked_norm = grad_norm if scaler is None else None
            bad = (f"the loss became {loss_val}" if not math.isfinite(loss_val) else
                   f"the gradient norm became {grad_norm}" if checked_norm is not None
                   and not math.isfinite(checked_norm) else None)
            notice = health.observe(step, loss_val, checked_norm, lr)
            if notice:
                say(notice)
            if bad:
                settle()  # a save in flight commits or names what diverged first
                retention.judge()
                raise divergence(step, bad)
            if pending is not None and pending.done():
                settle()
            else:
                retention.judge()
            progress.tick(step, loss_val)  # the status line on a terminal; nothing otherwise
            if profiler is not None:
                profiler.step()
            if step % t.log_interval == 0 or step == t.steps:
                progress.step(step, loss_val, lr, grad_norm, engine=counted.report())
            if step % t.eval_interval == 0 or step == t.steps:
                val_loss = evaluate(model, val_batches, model_loss, device, autocast)
                progress.eval(step, val_loss)
            if t.save_interval and step % t.save_interval == 0 and step < t.steps:
                save(step)
            stop = ""
            if t.stop_at and step >= t.stop_at and step < t.steps:
                stop = f"--stop-at {t.stop_at} reached"
            elif t.max_time and time.perf_counter() - t_start > t.max_time:
                stop = f"--max-time {t.max_time:g}s reached at step {step}"
            elif stopper is not None and stopper.received and step < t.steps:
                stop = f"{stopper.received} received; stopped at step {step}"
            if stop:
                if not t.keep_checkpoints:
                    say(f"{stop} (no checkpoint: --keep-checkpoints 0)")
                elif stopper is not None and stopper.received and not t.save_on_signal:
                    say(f"{stop} without a checkpoint of it (--no-save-on-signal); --resume continues from the "
                        "last one saved")
                else:
                    say(f"{stop}; continue with --resume")
                if step % t.eval_interval:
                    val_loss = evaluate(model, val_batches, model_loss, device, autocast)
                    progress.eval(step, val_loss)
                break

        seconds = time.perf_counter() - t_start
        # A signal that stopped the run before its last step (one during the final save lets the run end as it is).
        signalled = stopper.received if stopper is not None and stopper.received and step < t.steps else None
        progress.close()
        if profiler is not None:
            say(f"profile: {', '.join(str(f) for f in profiler.close())}")
        settle()  # a save in flight commits or names what diverged first
        export_failed: Exception | None = None
        if t.export_hf:  # before the last save, which takes the states' swap files over
            try:
                export_hf(model, mem, t.export_hf, check_finite=True)
                say(f"exported the model in the Hugging Face layout to {t.export_hf}")
            except NonFiniteWeight as e:  # the last save would refuse this state too
                retention.judge()
                raise divergence(step, f"{describe_key(e.key)} became {e.what}") from None
            except Exception as e:  # the last checkpoint is still taken, then the run ends with this
                export_failed = e
        if signalled is None or t.save_on_signal:
            save(step, last=True)
        settle()
        if export_failed is not None:
            raise export_failed
        retention.judge(final=True)
        path = last_good[1] if last_good else None
        if path is not None and verdict_of(path) == SUSPECT:
            from tightfit.train.divergence import resume_candidate

            good = resume_candidate(ckpt_root)
            say(f"warning: the final checkpoint (step {step}) was taken inside a loss spike (from step "
                f"{health.first_spike.step if health.first_spike else '?'}); "
                + (f"the newest healthy one is step {good[0]} in {good[1]}" if good else "no healthy one was kept"))
        summary = Summary(steps_done=step - start_step, final_step=step, train_loss=loss_val, val_loss=val_loss,
                          seconds=seconds, tokens_per_s=(step - start_step) * tokens_per_step / max(seconds, 1e-9),
                          checkpoint=path, peak_memory=mem.peak_memory(),
                          stopped_by=signalled, exit_code=stopper.exit_code if signalled else 0)
        progress.log({"kind": "summary", "steps": summary.steps_done, "final_step": step, "train_loss": loss_val,
                      "val_loss": val_loss, "seconds": seconds, "tokens_per_s": summary.tokens_per_s,
                      "peak_memory": summary.peak_memory})
        peaks = ", ".join(f"{k} {format_size(v)}" for k, v in summary.peak_memory.items())
        say(f"done: {summary.steps_done} steps in {format_duration(seconds)} ({summary.tokens_per_s:,.0f} tok/s), "
            f"train loss {loss_val:.4f}, val loss {val_loss:.4f} nats/token; peak memory {peaks}; "
            f"checkpoint {path or 'none'}")
        run_step_s = seconds / max(1, summary.steps_done)
        step_s = statistics.median(step_times) if step_times else run_step_s
        comparison = mem.compare_with_plan(step_s)
        if comparison:
            say(comparison)
            progress.log({"kind": "plan_vs_measured", **mem.plan_record(step_s, run_step_s)})
        if t.plot:
            from tightfit.train.pictures import plot_run

            say(f"picture of the run: {plot_run(out_dir)}")  # loss and memory per tier over the run
    except BaseException:
        if profiler is not None:
            with contextlib.suppress(Exception):
                profiler.close()
        if progress is not None:
            with contextlib.suppress(Exception):
                progress.close()  # clears a terminal's status line before the error is printed, flushes TensorBoard
        with contextlib.suppress(Exception):  # the error in flight is the one to report
            if pending is not None:
                pending.abort()
        with contextlib.suppress(Exception):
            mem.close()
        raise
    mem.close()  # stops the engine's threads and removes its swap files (the checkpoint has the state)
    return summary
