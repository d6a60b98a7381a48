"""`TightfitTrainer`: the Hugging Face `transformers.Trainer`, over a model whose states tightfit offloads.

The change to an existing Trainer script is two lines, the import and the class:

    from tightfit.integrations.hf_trainer import Placement, TightfitTrainer
    trainer = TightfitTrainer(model=model, args=args, train_dataset=ds,
                              placement=Placement.everywhere("nvme", nvme_dir="/mnt/swap"))
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=True)

A model already wrapped with `tightfit.wrap` is taken as is (no `placement`): that is the way to let the planner
choose, `tightfit.wrap(model, gpu_mem=..., cpu_mem=..., nvme=..., micro_batch=..., seq_len=...)`. A `peft` model
(LoRA) works the same: its frozen base weights are kept once, in the compute dtype, with no master, gradient or
moments; only the adapters have those.

Why a subclass and not a callback: the places where a stock Trainer goes wrong over a wrapped model are methods,
not events, and each is silent:
- clipping and the logged `grad_norm`. Trainer clips with `accelerator.clip_grad_norm_(model.parameters(), ...)`,
  i.e. over `param.grad`; a wrapped model's gradients live in the engine's tiers (`param.grad` stays None), so that
  clips nothing and reports 0. `_clip_grad_norm` / `_get_grad_norm` here use `tightfit.optim.AdamW.clip_grad_norm_`,
  the same formula as torch's (coefficient max_norm / (norm + 1e-6), at most 1) over the norms the engine took
  as the gradients were accumulated.
- the optimizer. A `torch.optim` optimizer steps nothing here; `create_optimizer` builds `tightfit.optim.AdamW`
  with Trainer's own parameter groups (no weight decay on biases and norms) and `TrainingArguments`' learning
  rate, betas, epsilon and weight decay. LR schedulers work unchanged (they edit `param_groups[i]["lr"]`).
- checkpoints. Trainer pickles `optimizer.state_dict()` into optimizer.pt; the state of a wrapped model is in the
  tiers, and pickles are never written here. The optimizer goes to `optimizer.safetensors` (optim_file.py), the
  scheduler to `scheduler.json`, the RNG states to `rng_state.safetensors` (rng_file.py), the training arguments
  to `training_args.json`, and the model is saved by `save_hf_model` (streamed from the tiers, a folder
  `from_pretrained` reads) or, for a peft model, by peft's own `save_pretrained` given the adapters' fp32 values.
  `train(resume_from_checkpoint=...)` is Trainer's own resume: it finds the folder, restores the step, the data
  position and the RNG, and calls the two loaders overridden here.
- several processes (`torchrun` / `accelerate launch`). accelerate would wrap the model in DDP, whose reducer
  hooks `param.grad` and broadcasts parameters a wrapped model keeps in its tiers. Here every rank holds the whole
  model through its own engine and the engine averages each unit's gradients over the ranks as they leave the
  device ([Note: gradients averaged as they leave] in tightfit/parallel/replicas.py); `_wrap_model` hands
  accelerate a `Replica` so it does not wrap it again. accelerate still deals each rank its share of every batch,
  so the step is DDP's. Each rank writes its RNG state (`rng_state_<rank>.safetensors`, as Trainer does); rank 0
  writes the rest. With `sharding` each unit has one owner among the ranks (tightfit/parallel/sharded_optimizer.py),
  which alone keeps its master and moments ("zero1"), and its gradients too, reduced to it ("zero2"), and its
  parameters too, each use's sent by their rank ("zero3", tightfit/parallel/params_exchange.py); under zero1/zero2
  the owners broadcast the new values after each optimizer step, beside the next forward (a post-step hook on the
  optimizer). The checkpoints are the same files, rank 0 writing what every owner sends it, and every rank reads its
  own units back from them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers

import tightfit
from tightfit.errors import UsageError
from tightfit.integrations.optim_file import OPTIMIZER_FILE, load_optimizer, save_optimizer
from tightfit.integrations.rng_file import RNG_FILE, load_rng, save_rng
from tightfit.offload.step.engine import find_engine
from tightfit.offload.placement import Placement
from tightfit.optim import AdamW
from tightfit.utils.safetensors_io import fsync_dir

__all__ = ["Placement", "TightfitTrainer", "tightfit_optimizer"]

SCHEDULER_FILE = "scheduler.json"
TRAINING_ARGS_FILE = "training_args.json"
# TrainingArguments(optim=...) values tightfit.optim.AdamW serves with the same math (fused is what it runs).
_ADAMW = ("adamw_torch", "adamw_torch_fused")
SHARDINGS = ("zero1", "zero2", "zero3")


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def tightfit_optimizer(opt: torch.optim.Optimizer | None) -> AdamW:
    """The `tightfit.optim.AdamW` inside `opt` (accelerate wraps it in an `AcceleratedOptimizer`)."""
    inner = opt
    while inner is not None and not isinstance(inner, AdamW) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, AdamW):
        raise UsageError(f"TightfitTrainer: the optimizer is {type(inner).__name__}, which cannot step a wrapped "
                         "model; pass optimizers=(tightfit.optim.AdamW(model.parameters(), ...), scheduler) or "
                         "leave optimizers unset")
    return inner


class TightfitTrainer(transformers.Trainer):
    """`transformers.Trainer` over a wrapped model; every other argument is Trainer's.

    placement: wrap `model` with this `tightfit.Placement` first (leave it None for a model already wrapped).
    compute_dtype: the dtype forward/backward compute in (fp32 master weights are kept); with
        `TrainingArguments(bf16=True)` it defaults to torch.bfloat16, else float32. Only used with `placement`.
    units: which modules are units (see `tightfit.wrap`); only used with `placement`.
    sharding: under several processes, "zero1" | "zero2" | "zero3": each rank holds the master and moments (zero1),
        and the gradients (zero2), and the parameters (zero3) of its own units alone, on its tiers as `placement`
        says (module docstring); None: every rank the whole model.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *more, placement: Placement | None = None, compute_dtype: torch.dtype | None = None,
                 units=None, sharding: str | None = None, **kwargs) -> None:
        if model is None:
            raise UsageError("TightfitTrainer: pass model=...; model_init is not supported (the model is wrapped "
                             "once, before training)")
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        if args.world_size > 1 and (args.fsdp or args.deepspeed):
            raise UsageError("TightfitTrainer: the engine holds the model on every rank and averages its gradients "
                             "(DDP); drop fsdp=/deepspeed= from TrainingArguments")
        if args.fp16:
            raise UsageError("TightfitTrainer: TrainingArguments(fp16=True) unscales param.grad, which a wrapped "
                             "model does not have; use bf16=True, or compute_dtype=torch.float16 without fp16")
        wrapped = find_engine(model) is not None
        owner = None
        if sharding is not None:
            if sharding not in SHARDINGS:
                raise UsageError(f"TightfitTrainer(sharding={sharding!r}): use 'zero1', 'zero2' or 'zero3' (each rank "
                                 "its own units' states) or None (every rank the whole model)")
            if placement is None or wrapped:
                raise UsageError(f"TightfitTrainer(sharding={sharding!r}): pass the unwrapped model and "
                                 "placement=...; the trainer wraps each rank's share")
            if _is_peft(model):
                raise UsageError(f"TightfitTrainer(sharding={sharding!r}): a peft model trains its adapters alone; "
                                 "leave sharding unset (every rank holds the frozen base once, in the compute dtype)")
            if args.world_size > 1:
                placement, owner = _rank_share(model, placement, args, sharding)
        if placement is not None:
            if wrapped:
                raise UsageError("TightfitTrainer: the model is already wrapped; drop placement=... (or pass the "
                                 "unwrapped model)")
            if compute_dtype is None:
                compute_dtype = torch.bfloat16 if args.bf16 else torch.float32
            tightfit.wrap(model, placement, compute_dtype=compute_dtype, device=args.device, units=units)
        elif not wrapped:
            raise UsageError("TightfitTrainer: the model is not wrapped; pass placement=tightfit.Placement..."
                             " or call tightfit.wrap(model, ...) first")
        engine = find_engine(model)
        if engine.device.type != args.device.type:
            raise UsageError(f"TightfitTrainer: the model was wrapped for {engine.device} but TrainingArguments "
                             f"train on {args.device}; wrap with device=args.device (or set use_cpu)")
        super().__init__(model, args, *more, **kwargs)
        if self.optimizer is not None:
            tightfit_optimizer(self.optimizer)  # refuse a torch optimizer now, not after a silent epoch
        self._sharded = None  # the owners, their exchange and the checkpoints' gathers (`_Sharded`)
        if args.world_size > 1 and engine.shipper.reduce is None:
            from tightfit.parallel.replicas import average_over_ranks

            averager = average_over_ranks(engine)
            if owner is not None:
                self._sharded = _Sharded(engine, owner, averager, sharding)
                if self.optimizer is not None:
                    self._sharded.follow(tightfit_optimizer(self.optimizer))

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Over several processes: the model in a `Replica`, which accelerate leaves unwrapped (no DDP: the engine
        averages the gradients)."""
        if self.args.world_size > 1 and find_engine(self.model) is not None:
            return model if isinstance(model, Replica) else Replica(model)
        return super()._wrap_model(model, training, dataloader)

    # ---- the model stays where the engine put it -------------------------------------------------------------

    def _move_model_to_device(self, model, device) -> None:
        """The engine placed every state when the model was wrapped (buffers on its device, parameters in their
        tiers); moving the module again would only touch storage-less views."""

    # ---- optimizer, clipping, grad_norm ---------------------------------------------------------------------

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is not None:
                if self.optimizer_cls_and_kwargs[0] is not AdamW:
                    raise UsageError("TightfitTrainer: optimizer_cls_and_kwargs must name tightfit.optim.AdamW")
            elif self.args.optim not in _ADAMW:
                raise UsageError(f"TightfitTrainer: TrainingArguments(optim={str(self.args.optim)!r}) is not "
                                 "available for a wrapped model; use optim='adamw_torch_fused' (tightfit.optim.AdamW)")
            else:
                self.optimizer_cls_and_kwargs = (AdamW, {"lr": self.args.learning_rate, "eps": self.args.adam_epsilon,
                                                         "betas": (self.args.adam_beta1, self.args.adam_beta2)})
        opt = super().create_optimizer(model)
        if self._sharded is not None:
            self._sharded.follow(tightfit_optimizer(opt))
        return opt

    def train(self, *args, **kwargs):
        """Trainer's; under zero1/zero2 the owners' last exchange is joined before it returns (the process may end
        its process group next)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._sharded is not None:
                self._sharded.join()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step; before the backward of a step's last micro-batch, each unit's master and moments start
        loading as its backward starts (`preload_during_backward`), so the optimizer step after backward waits for
        less. Not `step_during_backward`: Trainer reads the gradient norm after backward (it logs it), and stepped
        units would have consumed their gradients by then. The result is the same either way."""
        if self.accelerator.gradient_state.sync_gradients:
            tightfit_optimizer(self.optimizer).preload_during_backward()
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        """Clip to `max_grad_norm` inside the coming step; the norm before clipping (what Trainer logs)."""
        return tightfit_optimizer(self.optimizer).clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The global 2-norm of the accumulated gradients (`max_grad_norm=0`: nothing clipped, the norm logged)."""
        if grad_norm is None:
            norms = tightfit_optimizer(self.optimizer).grad_norms()
            grad_norm = float(torch.linalg.vector_norm(torch.stack(norms), 2.0)) if norms else 0.0
        return grad_norm

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under `sharding`, every rank takes part: rank 0 writes the model, the other owners send it their units."""
        if self._sharded is None:
            return super().save_model(output_dir, _internal_call)
        if self._sharded.writes:
            self._save(output_dir if output_dir is not None else self.args.output_dir)
        else:
            self._sharded.send(with_optim=False)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the model as `from_pretrained` (or peft's `PeftModel.from_pretrained`) reads it, streamed from the
        tiers; the training arguments as JSON (Trainer pickles them)."""
        if find_engine(self.model) is None:
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if _is_peft(self.model):
            # peft saves what `get_peft_model_state_dict` picks from the state dict it is given: the adapters, all
            # trainable. Their fp32 masters are read from the tiers; the frozen base is never gathered.
            from tightfit.offload.model_state.state_io import export_state

            values = {k.removeprefix("model."): v for k, v in export_state(self.model, trainable_only=True)}
            self.model.save_pretrained(out, state_dict=values, safe_serialization=True)
        elif isinstance(self.model, transformers.PreTrainedModel):
            from tightfit.models.hf_save import save_hf_model

            if self._sharded is not None:  # every unit's fp32 values, the other owners' sent to this rank
                save_hf_model(self.model, out, dtype=torch.float32, strip_prefix="model.",
                              tensors=self._sharded.gathered(with_optim=False))
            else:
                save_hf_model(self.model, out)
        else:
            raise UsageError(f"TightfitTrainer: cannot save a {type(self.model).__name__}; the model must be a "
                             "transformers PreTrainedModel or a peft PeftModel")
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        _write_json(out / TRAINING_ARGS_FILE, json.loads(self.args.to_json_string()))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._sharded is not None and not self._sharded.writes:
            self._sharded.send(with_optim=True)
            return
        if not self.args.should_save:
            return
        tensors = self._sharded.gathered(with_optim=True) if self._sharded is not None else None
        save_optimizer(self.model, tightfit_optimizer(self.optimizer), Path(output_dir) / OPTIMIZER_FILE, tensors)
        _write_json(Path(output_dir) / SCHEDULER_FILE, _scheduler_state(self.lr_scheduler))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint)
        if not (folder / OPTIMIZER_FILE).is_file():
            if (folder / transformers.trainer.OPTIMIZER_NAME).is_file():
                raise UsageError(f"resume_from_checkpoint: {folder} holds a pickled optimizer.pt (a stock Trainer's); "
                                 "tightfit never unpickles: resume from a TightfitTrainer checkpoint, or start fresh")
            return  # saved with save_only_model: fresh optimizer state, as Trainer does
        load_optimizer(self.model, tightfit_optimizer(self.optimizer), folder / OPTIMIZER_FILE)
        sched = folder / SCHEDULER_FILE
        if sched.is_file():
            self.lr_scheduler.load_state_dict(json.loads(sched.read_text()))

    def _rng_file(self, folder: str) -> Path:
        """Each rank's own where there are several (its shuffles and dropout are its own), as Trainer does."""
        name = RNG_FILE if self.args.world_size <= 1 else RNG_FILE.replace(".", f"_{self.args.process_index}.", 1)
        return Path(folder) / name

    def _save_rng_state(self, output_dir: str) -> None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        save_rng(self._rng_file(output_dir))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._rng_file(checkpoint).is_file():
            load_rng(self._rng_file(checkpoint))  # else: none saved, as Trainer goes on without one

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Model weights on resume: the optimizer file holds every trainable parameter's fp32 master (loaded with
        it, exact even where the saved model is in a lower dtype) and frozen parameters never changed, so with that
        file there is nothing to read here. Without it (save_only_model), the saved model is loaded."""
        if find_engine(self.model) is not None and (Path(resume_from_checkpoint) / OPTIMIZER_FILE).is_file():
            return
        if find_engine(self.model) is not None and not _is_peft(self.model):
            from tightfit.models.hf_load import HFCheckpoint
            from tightfit.models.hf_wrap import fill_wrapped

            fill_wrapped(self.model, HFCheckpoint.open(resume_from_checkpoint))
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


def _rank_share(model: torch.nn.Module, placement: Placement, args, sharding: str
                ) -> tuple[Placement, dict[str, int]]:
    """(`placement` for this rank's share under `sharding`, every unit's owner)."""
    from dataclasses import replace

    from tightfit.parallel.sharded_optimizer import shard_setup

    owner, elsewhere = shard_setup(model, args.process_index, args.world_size, sharding)
    share = replace(placement, stepped_elsewhere=sorted(elsewhere), grads_elsewhere=sharding != "zero1")
    return (replace(share, exchanged=sorted(owner)) if sharding == "zero3" else share), owner


class _Sharded:
    """ZeRO-1/2/3 under TightfitTrainer: the clip's norms summed over the owners (zero2, zero3), the new values sent
    by their owners after each step (zero1, zero2) or each use's parameters sent by their rank (zero3), and the
    checkpoints' gathers to rank 0 (groups of their own, made alike on every rank)."""

    def __init__(self, engine, owner: dict[str, int], averager, sharding: str) -> None:
        import torch.distributed as dist

        from tightfit.parallel.params_exchange import exchange_params
        from tightfit.parallel.sharded_optimizer import UnitOwners

        self.engine = engine
        self.sharding = sharding
        self.writes = dist.get_rank() == 0
        self.owners = UnitOwners(engine, owner, averager, dist.new_group(backend=dist.get_backend()), sharding)
        if sharding == "zero3":
            exchange_params(engine, owner, dist.new_group(backend=dist.get_backend()))
        self.gathers = dist.new_group(backend="gloo")  # point to point between host tensors
        self._followed = None  # the optimizer whose steps start an exchange

    def follow(self, opt: AdamW) -> None:
        """Under zero1/zero2, each step of `opt` starts the owners' exchange of the new values (`UnitOwners.start`,
        as `tightfit train` does after `opt.step()`); zero3 sends parameters as each use asks for them."""
        if self.sharding == "zero3" or opt is self._followed:
            return
        self._followed = opt
        opt.register_step_post_hook(lambda *_: self.owners.start())

    def join(self) -> None:
        """The exchange in flight is done (its error raised here)."""
        self.owners.join()

    def gathered(self, with_optim: bool):
        """Rank 0: every unit's (key, tensor) as `export_state` names them, the other owners' received."""
        from tightfit.offload.model_state.state_io import quiesce
        from tightfit.parallel.sharded_optimizer import Gathered

        self.join()
        quiesce(self.engine)
        for _, items in Gathered(self.engine, self.owners.units, with_optim, False, self.gathers, pieces=True):
            yield from items

    def send(self, with_optim: bool) -> None:
        """Another rank's side of `gathered`: its own units, in the engine's order."""
        from tightfit.offload.model_state.state_io import quiesce
        from tightfit.parallel.sharded_optimizer import send_owned

        self.join()
        quiesce(self.engine)
        send_owned(self.engine, self.owners.units, self.owners.rank, with_optim, self.gathers)


class Replica(torch.nn.Module):
    """A wrapped model as accelerate sees it under several processes: a module that is not the model, so accelerate
    prepares the optimizer and the data but does not wrap the model in DDP. `module` is the model (what
    `unwrap_model` returns)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _scheduler_state(scheduler) -> dict:
    """The LR scheduler's `state_dict()` as JSON (Trainer's schedulers hold numbers and lists only)."""
    state = scheduler.state_dict()
    try:
        json.dumps(state)
    except TypeError:
        raise UsageError(f"TightfitTrainer: the LR scheduler {type(scheduler).__name__} keeps state that is not "
                         "plain numbers (e.g. a callable object); use one of Trainer's lr_scheduler_type "
                         "values") from None
    return state


def _write_json(path: Path, value) -> None:
    """Atomically: the previous file survives a failed write."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
