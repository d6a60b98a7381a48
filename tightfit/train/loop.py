"""The training loop behind `tightfit train`, for every world size, readable top to bottom.

One step: for each of `grad_accum` micro-batches, forward under autocast and backward (loss divided by the
accumulation count); clip the global gradient norm; optimizer step; zero gradients. The same loop serves plain
PyTorch, offloaded models and a process group's parallelised model: what differs is the trainee the world hands
back (`World.trainee`: tightfit/train/trainee.py in one process, tightfit/parallel/trainee.py over a group; the
parallel wrapping is a transform applied before the loop), and the decisions every rank takes together, which one
process takes alone (world.py). `run` sets up; `Run` is the loop, in named parts: `step`, `evaluate`,
`stop_reason`, `finish`, with the checkpoints in `Saver` (saving.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tightfit.config import Config, compute_device_type, precision_name
from tightfit.errors import UsageError
from tightfit.offload.step.loss_scale import load_scaler_state, scaler_state
from tightfit.train import checkpoint as ckpt
from tightfit.train.checkpoint_writer import check_room, checkpoint_bytes, clean_leftovers, committed
from tightfit.train.data import TokenDataset, data_generator, load_tokens
from tightfit.train.divergence import describe_key, diverged
from tightfit.train.health import SUSPECT, RunHealth, verdict_of
from tightfit.train.memory import check_buildable
from tightfit.train.preflight import check_outputs
from tightfit.train.progress import EngineWindow, Progress, format_duration
from tightfit.train.retention import Retention
from tightfit.train.saving import Saver
from tightfit.train.signals import GracefulStop
from tightfit.train.tensorboard import open_sink
from tightfit.train.trainee import NonFiniteWeight
from tightfit.train.world import World
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


def load_dataset(cfg: Config, tokenizer, say=None):
    """The corpus --data names, split (a TokenDataset), or its records tokenized into examples (an ExampleDataset,
    tightfit/finetune/examples.py); `say` gets the progress of a tokenizer's encoding."""
    from tightfit.finetune.records import is_records

    if is_records(cfg.data.data):
        from tightfit.finetune.examples import load_examples
        from tightfit.models.tokenizer import get_tokenizer

        isolation = None
        if cfg.data.packing:  # before the tokenizing: a model that cannot take packed rows is refused at once
            from tightfit.finetune.packed_attention import check_packing

            isolation = check_packing(cfg)
        return load_examples(cfg, tokenizer if tokenizer is not None else get_tokenizer(None),
                             say or (lambda s: None), isolation=isolation)
    tokens = load_tokens(cfg.data.data, tokenizer, say)
    vocab = tokenizer.vocab_size if tokenizer is not None else 256
    return TokenDataset.from_tokens(tokens, cfg.train.seq_len, cfg.data.val_fraction, vocab)


def build_meta_model(cfg: Config, adapters: bool = True) -> torch.nn.Module:
    """The model `cfg` names, on the meta device: shapes for planning, no memory, no weights read. With --lora, its
    adapters on it (the base frozen) unless `adapters` is False (the base alone: what a merged export writes)."""
    from tightfit.models.build import hf_path
    from tightfit.models.gpt import GPT, GPTConfig

    path = hf_path(cfg.model.model)
    if path is None:
        m = cfg.model
        with torch.device("meta"):
            return GPT(GPTConfig(vocab_size=_vocab_size(cfg), block_size=cfg.train.seq_len, n_layer=m.n_layer,
                                 n_head=m.n_head, n_embd=m.n_embd))
    from tightfit.models.build import build_model

    model = build_model(cfg.model, vocab_size=_vocab_size(cfg), block_size=cfg.train.seq_len, device="meta")
    if cfg.model.lora and adapters:
        from tightfit.finetune.lora import add_lora

        model = add_lora(model, cfg.model.lora, seed=cfg.train.seed)
    return model


def parameter_count(cfg: Config) -> int:
    """The parameters of the model `cfg` names: the reference GPT's counted without building it, a Hugging Face
    model's on the meta device."""
    from tightfit.models.build import hf_path
    from tightfit.models.gpt import GPTConfig, parameter_count as gpt_count

    if hf_path(cfg.model.model) is None:
        m = cfg.model
        return gpt_count(GPTConfig(vocab_size=_vocab_size(cfg), block_size=cfg.train.seq_len, n_layer=m.n_layer,
                                   n_head=m.n_head, n_embd=m.n_embd))
    return sum(p.numel() for p in build_meta_model(cfg).parameters())


def _vocab_size(cfg: Config) -> int:
    from tightfit.models.tokenizer import get_tokenizer, tokenizer_folder

    folder = tokenizer_folder(cfg)
    return get_tokenizer(folder).vocab_size if folder else 256


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
    """Run `tightfit train` in this process with a validated config. Raises UsageError on bad input."""
    from tightfit.utils.run_lock import RunLock

    check_outputs(cfg)  # every path the run writes, before anything runs (preflight.py)
    # One run per --out-dir (utils/run_lock.py): a second one is refused with one line naming this run's PID.
    # A stop signal ends the run at the end of a step, with a checkpoint (signals.py).
    with RunLock.acquire(cfg.train.out_dir, "--out-dir"), GracefulStop(save=cfg.train.save_on_signal) as stopper:
        return run(cfg, World(), quiet=quiet, stopper=stopper)


def _use_threads(threads: int, say) -> None:
    if not threads:
        return
    cores = os.cpu_count() or 1
    if threads > cores:  # 100,000 segfaulted in OpenMP; thousands made a step take minutes
        say(f"notice: --threads {threads} is more than this machine's {cores} cores; using {cores}")
    torch.set_num_threads(min(threads, cores))


def run(cfg: Config, world: World, *, quiet: bool = False, stopper: GracefulStop | None = None) -> Summary:
    """The training loop, for a world of any size (world.py): set up, then `Run.train`. Every rank runs it; the
    main rank prints, writes the metrics and commits the checkpoints."""
    from tightfit.models.build import build_model, hf_path
    from tightfit.models.tokenizer import get_tokenizer, tokenizer_folder

    t = cfg.train
    say = (lambda s: None) if quiet or not world.is_main else (lambda s: print(s, flush=True))
    _use_threads(t.threads, say)
    device = world.device(cfg)
    dtype = resolve_precision(cfg, device)
    out_dir = Path(t.out_dir)
    if not t.resume and ckpt.latest(out_dir) is not None:
        raise UsageError(f"--out-dir: {out_dir} already holds a checkpoint; pass --resume to continue it, "
                         "or choose another --out-dir")
    if t.export_hf and hf_path(cfg.model.model) is None:
        raise UsageError("--export-hf: only Hugging Face models (--model hf:PATH) can be exported in that layout; "
                         "the reference GPT's weights are in the checkpoint")

    torch.manual_seed(t.seed)  # the same seed on every rank: identical initial weights, no broadcast
    # Byte-level text takes the fast path (raw bytes are the token ids); a named tokenizer encodes the text.
    folder = tokenizer_folder(cfg)
    tokenizer = get_tokenizer(folder) if folder else None
    dataset = load_dataset(cfg, tokenizer, say=say)
    stream = world.streams_weights(cfg)
    if not stream:  # measured on the meta device first: one too large to build is refused, not allocated
        check_buildable(parameter_count(cfg), cfg, device.type)
    model = build_model(cfg.model, vocab_size=dataset.vocab_size, block_size=t.seq_len,
                        device="meta" if stream else "cpu")
    if cfg.model.lora:  # adapters on the frozen base, before any state is planned or loaded (finetune/lora.py)
        from tightfit.finetune.lora import add_lora

        model = add_lora(model, cfg.model.lora, seed=t.seed, base=str(Path(hf_path(cfg.model.model)).resolve()))
    # load_checkpoint refuses a missing, truncated or foreign file with a one-line --resume error.
    # Every tensor's name, shape and dtype is checked against this model, and the metadata, before any is loaded.
    resume = ckpt.load_checkpoint(out_dir, step=t.resume_step) if t.resume else None
    if resume is not None:
        ckpt.check_compatible(resume, [(n, tuple(p.shape)) for n, p in model.named_parameters()])
        other = ckpt.changed_model(resume.config, cfg.to_dict())
        if other is not None:
            flag, was, now = other
            raise UsageError(f"{flag}: the checkpoint in {out_dir} was trained with {flag} {was}, this run asks for "
                             f"{now}: another model with the same shapes; resume with {flag} {was}, or train the new "
                             "model in another --out-dir")
        resume.check_rng()  # before any tier is written
    start_step = resume.step if resume is not None else 0
    room = Room(cfg, out_dir, model, start_step)
    # The checkpoints must fit beside the swap files: checked on the plan, before the engine fills them.
    early = (lambda plan: room.check(plan, plan.prediction.peak.get("nvme", 0))) \
        if t.keep_checkpoints and t.steps > start_step and world.is_main else None
    trainee = world.trainee(model, cfg, device, dtype, resume, planned=early, say=say)
    loop = None
    try:
        if not trainee.takes_examples and (dataset.answers_only or cfg.model.lora):
            what = "--lora" if cfg.model.lora else f"records (--data {cfg.data.data})"
            raise UsageError(f"--strategy: {what} train in one process, or on several with --strategy ddp --offload "
                             "host|nvme (the engine on every rank); the FSDP, tensor- and pipeline-parallel strategies "
                             "take a text corpus and a whole model")
        say(trainee.describe())
        loop = Run(cfg, world, trainee, dataset, resume, say, quiet, stopper, room)
        summary = loop.train()
    except BaseException:
        if loop is not None:
            loop.fail()
        with contextlib.suppress(Exception):  # the error in flight is the one to report
            trainee.close()
        raise
    trainee.close()  # stops the engine's threads and removes its swap files (the checkpoint has the state)
    return summary


class Room:
    """Whether the checkpoints this run keeps fit `--out-dir` beside the swap files (check_room)."""

    def __init__(self, cfg: Config, out_dir: Path, model: torch.nn.Module, start_step: int) -> None:
        self.cfg, self.out_dir, self.start_step = cfg, out_dir, start_step
        self.shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.parameters = sum(p.numel() for p in model.parameters())
        self.trained = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def check(self, plan, swap_to_come: int = 0) -> tuple[int, int, int, str]:
        """(per checkpoint, need, free, note), or UsageError naming --out-dir."""
        t, out_dir = self.cfg.train, self.out_dir
        per = checkpoint_bytes(self.shapes, self.trainable)
        shared = shares_disk(self.cfg, out_dir)
        frees = last_save_frees(self.cfg, out_dir, plan)
        note = ("" if not shared else "the --nvme swap files, already allocated, share this disk" if not swap_to_come
                else f"the {format_size(swap_to_come)} of --nvme swap files this plan keeps share this disk")
        if frees:
            note += f", and the last save takes {format_size(frees)} of them over"
        saves = 1 + ((t.steps - 1 - self.start_step) // t.save_interval if t.save_interval else 0)  # + the last
        root = out_dir / ckpt.CHECKPOINT_NAME
        need, free = check_room(out_dir, per, keep=t.keep_checkpoints, kept=len(committed(root)), saves=saves,
                                note=f" ({note})" if note else "", reserved=swap_to_come if shared else 0,
                                last_frees=frees)
        return per, need, free, note


class Run:
    """One run's loop, in named parts: `train` (the loop), `step`, `evaluate`, `stop_reason`, `finish`."""

    def __init__(self, cfg: Config, world: World, trainee, dataset: TokenDataset, resume, say, quiet: bool,
                 stopper: GracefulStop | None, room: Room) -> None:
        t = cfg.train
        self.cfg, self.world, self.trainee, self.dataset, self.say, self.stopper = cfg, world, trainee, dataset, say, \
            stopper
        self.out_dir = Path(t.out_dir)
        self.ckpt_root = self.out_dir / ckpt.CHECKPOINT_NAME
        self.start_step = resume.step if resume is not None else 0
        self.resume_path = resume.path if resume is not None else None
        self.health_record = resume.health if resume is not None else None  # the loss around its checkpoints
        self.profiler = None  # --profile DIR: records a few steps (profiling.py)
        self.progress = None  # the status line and the metrics' sinks (progress.py)
        self.saver = None
        # One data position for every rank: each data-parallel rank takes its share of each step's global batch
        # (TokenDataset.step_batches); the ranks of a pipeline or a tensor-parallel group share one.
        self.gen = data_generator(t.seed)
        if resume is not None:
            self._resume(resume)
        self.room = room
        self.quiet = quiet
        self.answers = dataset.answers_only  # records: the loss and tokens/s count answer tokens

    def _resume(self, resume) -> None:
        """The data position, the RNGs and the loss scaler of the checkpoint; the state is in the trainee already.
        The data position is the run's, not a rank's: any number of ranks continues at the same sequences."""
        ckpt.restore_rng(resume.rng_states(), self.gen)
        load_scaler_state(self.trainee.scaler, resume.loss_scaler)
        resume.close()  # its shards' file handles
        self.say(f"resumed from {resume.path} at step {self.start_step}")
        if verdict_of(resume.path) == SUSPECT:
            from tightfit.train.divergence import resume_candidate

            good = resume_candidate(self.ckpt_root)
            self.say(f"warning: the checkpoint of step {self.start_step} was taken inside a loss spike (marked suspect "
                     "by the run that wrote it); " + (f"the newest healthy one is step {good[0]}: --resume-step "
                                                      f"{good[0]}" if good else "no healthy one was kept"))
        changed = ckpt.changed_settings(resume.config, self.cfg.to_dict())
        if changed:
            self.say(f"notice: resuming with settings changed since the checkpoint: {', '.join(changed)}")

    def _draw(self, step: int) -> list:
        """This rank's batches for step `step`: --grad-accum micro-batches, or one batch a pipeline splits."""
        t, trainee = self.cfg.train, self.trainee
        size, count = (t.micro_batch * t.grad_accum, 1) if trainee.whole_batch else (t.micro_batch, t.grad_accum)
        return self.dataset.step_batches(size, count, self.gen, trainee.data_rank, trainee.data_ranks, step=step)

    def fail(self) -> None:
        """The run is failing: stop the profiler and the status line, drop the save in flight."""
        if self.profiler is not None:
            with contextlib.suppress(Exception):
                self.profiler.close()
        if self.progress is not None:
            with contextlib.suppress(Exception):
                self.progress.close()  # clears a terminal's status line before the error is printed
        if self.saver is not None:
            with contextlib.suppress(Exception):
                self.saver.abort()

    def divergence(self, at: int, what: str) -> UsageError:
        return diverged(at, what, root=self.ckpt_root, lr=self.lr, spike=self.health.first_spike, optim=self.cfg.optim)

    def _prepare(self) -> None:
        """What the loop needs once the state is in place: the checkpoint folder checked, the metrics opened."""
        t, world, say = self.cfg.train, self.world, self.say
        failed = None
        if world.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            removed = clean_leftovers(self.ckpt_root)
            if removed:
                say(f"removed what an interrupted save left in {self.ckpt_root}: {', '.join(removed)}")
            if t.keep_checkpoints:
                try:
                    per, need, free, note = self.room.check(self.trainee.plan)  # again: the swap files are there
                    say(f"checkpoint: {format_size(per)} per save in {self.ckpt_root} ({format_size(free)} free now, "
                        f"keeping {t.keep_checkpoints}: {format_size(need)} more at the peak"
                        f"{'; ' + note if note else ''})")
                except UsageError as e:
                    failed = e
            else:
                say("checkpoint: none (--keep-checkpoints 0)")
        if world.any_rank(failed is not None, "the --out-dir room check"):
            raise failed or world.raised_everywhere(UsageError(f"rank {world.rank}: stopping: rank 0 found no room "
                                                               "for the checkpoints"))
        self.tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * self.trainee.data_ranks
        shown = world.is_main and not self.quiet
        tensorboard = open_sink(t.tensorboard, self.out_dir) if shown else None
        self.progress = Progress(t.steps, self.start_step, self.tokens_per_step, self.out_dir / "metrics.jsonl",
                                 self.trainee.memory_in_use, enabled=shown, sinks=[tensorboard] if tensorboard else [],
                                 counted=self.answers)
        # The held-out batches, dealt round-robin to the data ranks by the trainee.
        self.val_batches = self.dataset.val_batches(
            t.eval_batches, t.micro_batch * (t.grad_accum if self.trainee.whole_batch else 1), seed=t.seed + 1)
        self.health = RunHealth.resumed(self.health_record)
        self.retention = Retention(self.ckpt_root, t.keep_checkpoints, self.health, self.start_step, say)
        self.saver = Saver(self.ckpt_root, t.keep_checkpoints, self.trainee, world, self.retention, self.health,
                           fields=lambda: {"config": self.cfg.to_dict(), "rng": ckpt.capture_rng(self.gen),
                                           "loss_scaler": scaler_state(self.trainee.scaler)},
                           divergence=self.divergence)
        if self.resume_path is not None:
            self.saver.last_good = (self.start_step, self.resume_path)
        if t.profile and world.is_main:
            from tightfit.train.profiling import StepProfiler

            self.profiler = StepProfiler(t.profile, plan=self.trainee.plan, cuda=self.trainee.device.type == "cuda")

    def train(self) -> Summary:
        t, say, world, trainee = self.cfg.train, self.say, self.world, self.trainee
        if self.start_step == t.steps and t.export_hf:  # export what a finished run saved, without training more
            self._export(check_finite=False)
            say(f"exported the model of {self.resume_path} (step {self.start_step}) in the Hugging Face layout to "
                f"{t.export_hf}")
            return Summary(steps_done=0, final_step=self.start_step, train_loss=float("nan"), val_loss=float("nan"),
                           seconds=0.0, tokens_per_s=0.0, checkpoint=self.resume_path,
                           peak_memory=trainee.peak_memory())
        if self.start_step >= t.steps:
            raise UsageError(f"--steps: the checkpoint is already at step {self.start_step}; ask for more than that "
                             f"(or, to export it, --steps {self.start_step} with --export-hf)")
        self._prepare()
        if self.answers:
            say(self.dataset.describe())
            trained = "" if self.room.trained == self.room.parameters else f" ({self.room.trained:,} trained)"
            say(f"training {self.room.parameters:,} parameters{trained} on {trainee.device} "
                f"({str(trainee.dtype)[6:]}), {self.tokens_per_step:,} token positions per step; the loss and tok/s "
                "count only the tokens that carry loss (answer tokens)")
        else:
            say(f"training {self.room.parameters:,} parameters on {trainee.device} ({str(trainee.dtype)[6:]}), "
                f"{len(self.dataset.train):,} train / {len(self.dataset.val):,} val tokens, {self.tokens_per_step:,} "
                "tokens per step")
        t_start = time.perf_counter()
        step, self.loss, self.val_loss, self.lr = self.start_step, float("nan"), float("nan"), self.cfg.optim.lr
        # [Note: the step the plan predicts] The plan predicts one optimizer step in the steady state: the median
        # of the last STEPS_TIMED steps (their micro-batches, clip, step and the loss read back, which waits for
        # the device) is what its prediction is compared with; evaluation, saves and a first step's warm-up are not
        # steps. The run's own rate, everything included, is the summary's tokens/s.
        self.step_times: deque[float] = deque(maxlen=STEPS_TIMED)
        counted = EngineWindow(trainee.engine_counters)  # the engine's bytes and seconds per step, for each report
        self.signalled = 0  # the signal that stopped the run, agreed by every rank
        while step < t.steps:
            t_step = time.perf_counter()
            counted.begin()
            norm = self.step(step)
            step += 1
            self.step_times.append(time.perf_counter() - t_step)
            counted.end(self.step_times[-1])
            self._check_health(step, norm)
            self.progress.tick(step, self.loss)  # the status line on a terminal; nothing otherwise
            if self.profiler is not None:
                self.profiler.step()
            if step % t.log_interval == 0 or step == t.steps:
                self.progress.step(step, self.loss, self.lr, norm, engine=counted.report())
            if step % t.eval_interval == 0 or step == t.steps:
                self.evaluate(step)
            if t.save_interval and step % t.save_interval == 0 and step < t.steps:
                self.saver.save(step)
            stop = self.stop_reason(step, time.perf_counter() - t_start)
            if stop:
                self._announce_stop(stop)
                if step % t.eval_interval:
                    self.evaluate(step)
                break
        return self.finish(step, time.perf_counter() - t_start)

    def step(self, step: int) -> float | None:
        """One optimizer step: the micro-batches' forward and backward, clip, step, zero; the norm before clipping.
        Sets `self.loss`, the step's loss every rank agrees on (read back once a step)."""
        self.lr = lr_at(step, self.cfg)
        for group in self.trainee.optimizer.param_groups:
            group["lr"] = self.lr
        batches = self._draw(step)
        if self.answers:  # the progress line counts the tokens that carry loss
            self.progress.count_tokens(self.dataset.last_step_tokens)
        with self.world.collective(f"training step {step + 1} (forward, backward, gradient reduction, loss "
                                   "all-reduce)"):
            local = self.trainee.accumulate(batches)
            norm = self.trainee.clip_and_step(self.cfg.optim.grad_clip)
            self.loss = self.trainee.global_loss(local)
        return norm

    def _check_health(self, step: int, norm: float | None) -> None:
        """The loss and the norm are every rank's: a divergence stops every rank alike, the main rank says it."""
        # An fp16 scaler skips a step whose gradients overflowed (its norm is inf then): not a divergence.
        checked = norm if self.trainee.scaler is None else None
        bad = (f"the loss became {self.loss}" if not math.isfinite(self.loss) else
               f"the gradient norm became {norm}" if checked is not None and not math.isfinite(checked) else None)
        notice = self.health.observe(step, self.loss, checked, self.lr)
        if notice:
            self.say(notice)
        if bad:
            self.saver.settle()  # a save in flight commits or names what diverged first
            self.retention.judge()
            raise self.world.raised_everywhere(self.divergence(step, bad))
        self.saver.poll()
        self.retention.judge()  # the verdict of the checkpoint before this step

    def evaluate(self, step: int) -> None:
        with self.world.collective(f"evaluation at step {step}"):
            self.val_loss = self.trainee.evaluate(self.val_batches)  # collective: every rank evaluates
        self.progress.eval(step, self.val_loss)

    def stop_reason(self, step: int, seconds: float) -> str:
        """Why the run stops after `step` ("" to go on). The ranks vote: clocks differ, a signal may reach one."""
        t = self.cfg.train
        if t.stop_at and t.stop_at <= step < t.steps:
            return f"--stop-at {t.stop_at} reached"
        if not (t.max_time or step < t.steps):
            return ""
        signum = self.stopper.signum if self.stopper is not None and step < t.steps else 0
        late, signum = self.world.max_over_ranks([int(bool(t.max_time) and seconds > t.max_time), signum or 0],
                                                 f"the stop vote (--max-time, signals) after step {step}")
        if late:
            return f"--max-time {t.max_time:g}s reached at step {step}"
        if signum:
            self.signalled = signum
            return f"{signal.Signals(signum).name} received; stopped at step {step}"
        return ""

    def _announce_stop(self, stop: str) -> None:
        t = self.cfg.train
        if not t.keep_checkpoints:
            self.say(f"{stop} (no checkpoint: --keep-checkpoints 0)")
        elif self.signalled and not t.save_on_signal:
            self.say(f"{stop} without a checkpoint of it (--no-save-on-signal); --resume continues from the last one "
                     "saved")
        else:
            self.say(f"{stop}; continue with --resume")

    def _export(self, check_finite: bool) -> None:
        with self.world.collective("the Hugging Face export"):
            self.trainee.export_hf(self.cfg.train.export_hf, lambda: build_meta_model(self.cfg, adapters=False),
                                   check_finite, merge_lora=self.cfg.train.merge_lora)

    def finish(self, step: int, seconds: float) -> Summary:
        """The end of the loop: the last checkpoint (and the export before it), the summary, the plan's report."""
        t, say, trainee = self.cfg.train, self.say, self.trainee
        self.progress.close()
        if self.profiler is not None:
            say(f"profile: {', '.join(str(f) for f in self.profiler.close())}")
            self.profiler = None
        self.saver.settle()  # a save in flight commits or names what diverged first
        export_failed: Exception | None = None
        if t.export_hf:  # before the last save, which takes the states' swap files over
            try:
                self._export(check_finite=True)
                say(f"exported the model in the Hugging Face layout to {t.export_hf}")
            except NonFiniteWeight as e:  # the last save would refuse this state too
                self.retention.judge()
                raise self.divergence(step, f"{describe_key(e.key)} became {e.what}") from None
            except Exception as e:  # the last checkpoint is still taken, then the run ends with this
                export_failed = e
        if not self.signalled or t.save_on_signal:
            self.saver.save(step, last=True)
        self.saver.settle()
        if export_failed is not None:
            raise export_failed
        self.retention.judge(final=True)
        path = self.saver.last_good[1] if self.saver.last_good else None
        if self.world.is_main and path is not None and verdict_of(path) == SUSPECT:
            from tightfit.train.divergence import resume_candidate

            good = resume_candidate(self.ckpt_root)
            spike = self.health.first_spike
            say(f"warning: the final checkpoint (step {step}) was taken inside a loss spike (from step "
                f"{spike.step if spike else '?'}); "
                + (f"the newest healthy one is step {good[0]} in {good[1]}" if good else "no healthy one was kept"))
        done = step - self.start_step
        summary = Summary(steps_done=done, final_step=step, train_loss=self.loss, val_loss=self.val_loss,
                          seconds=seconds, tokens_per_s=(self.progress.tokens if self.answers else
                                                         done * self.tokens_per_step) / max(seconds, 1e-9),
                          checkpoint=path, peak_memory=trainee.peak_memory(),
                          stopped_by=signal.Signals(self.signalled).name if self.signalled else None,
                          exit_code=128 + self.signalled if self.signalled else 0)
        self.progress.log({"kind": "summary", "steps": done, "final_step": step, "train_loss": self.loss,
                           "val_loss": self.val_loss, "seconds": seconds, "tokens_per_s": summary.tokens_per_s,
                           "peak_memory": summary.peak_memory, **trainee.summary_fields()})
        peaks = ", ".join(f"{k} {format_size(v)}" for k, v in summary.peak_memory.items())
        say(f"done: {done} steps in {format_duration(seconds)} ({summary.tokens_per_s:,.0f} "
            f"{'answer ' if self.answers else ''}tok/s), train loss "
            f"{self.loss:.4f}, val loss {self.val_loss:.4f} nats/token; peak memory {peaks}; checkpoint "
            f"{path or 'none'}")
        run_step_s = seconds / max(1, done)
        step_s = statistics.median(self.step_times) if self.step_times else run_step_s
        comparison = trainee.compare_with_plan(step_s)
        if comparison:
            say(comparison)
            self.progress.log({"kind": "plan_vs_measured", **trainee.plan_record(step_s, run_step_s)})
        if t.plot and self.world.is_main:
            from tightfit.train.pictures import plot_run

            say(f"picture of the run: {plot_run(self.out_dir)}")  # loss and memory per tier over the run
        return summary
