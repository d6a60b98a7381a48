"""What the training loop trains, in one process: the model as `setup_memory` holds it, with the loop's four verbs.

Why its own object: the loop (loop.py) is the same for every world size; what it trains is not. In one process it
is a `MemorySetup` (plain PyTorch, or the offload engine with its plan); over a process group it is this rank's
part of a parallelised model (tightfit/parallel/trainee.py). Both answer the same calls:
- `accumulate(batches)`: one step's micro-batches, forward and backward, in the plan's order; the step's mean
  loss on this rank, left on the device (read once a step, by `global_loss`);
- `clip_and_step(max_norm)`: clip the global gradient norm, step, zero; the norm before clipping (None unclipped);
- `global_loss(local)` and `evaluate(batches)`: the losses every rank agrees on;
- `checkpoint_groups(hand_over)`: what a checkpoint holds, a group at a time (None on a rank that does not write);
  `export_hf(folder, check_finite)`: the model in the Hugging Face layout;
and report memory, the engine's counters and the plan against the measured step where there is a plan.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from tightfit.train.batch import as_batch, batch_loss
from tightfit.train.memory import MemorySetup, setup_memory


class NonFiniteWeight(Exception):
    """A weight an export found NaN or infinite (`key`, `what`: as the checkpoint writer says it)."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(key, what)
        self.key, self.what = key, what


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float:
    """The mean of the batches' losses (tightfit/train/batch.py), dropout off meanwhile."""
    was_training = model.training
    model.eval()
    total = 0.0
    for b in batches:
        with autocast():
            total += batch_loss(model, as_batch(b), device, 1).item()
    model.train(was_training)
    return total / len(batches)


def autocast_for(device: torch.device, dtype: torch.dtype):
    """The context a forward runs in: autocast to `dtype`, or nothing in fp32."""
    return (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else nullcontext


class OneProcess:
    """The whole model in this process, held by `mem` (a MemorySetup). Every rank-wide answer is this rank's."""

    data_rank, data_ranks = 0, 1
    """This rank's share of the sample stream, and how many shares there are."""
    whole_batch = False
    """A step draws one batch of `--micro-batch x --grad-accum` sequences (a pipeline splits it), not micro-batches."""
    takes_examples = True
    """Trains on fine-tuning batches (tightfit/train/batch.py: masks, packed positions, the step's token count)."""

    def __init__(self, mem: MemorySetup, device: torch.device, dtype: torch.dtype) -> None:
        self.mem, self.device, self.dtype = mem, device, dtype
        self.model, self.optimizer = mem.model, mem.optimizer
        self.scaler = getattr(mem, "scaler", None)  # fp16 only: its state is part of a checkpoint
        self.plan = getattr(mem, "plan", None)
        self.autocast = autocast_for(device, dtype)

    def describe(self) -> str:
        return self.mem.describe()

    def accumulate(self, batches: list) -> torch.Tensor:
        """`batches`: Batch objects or (inputs, targets) pairs (tightfit/train/batch.py)."""
        def forward(b):
            with self.autocast():
                return batch_loss(self.model, b, self.device, len(batches))

        # In the plan's order (micro-batch or unit major: MemorySetup.accumulate); summed on the device: one host
        # sync a step, not one per micro-batch.
        total = torch.zeros((), device=self.device)
        for loss in self.mem.accumulate([lambda b=as_batch(b): forward(b) for b in batches]):
            total += loss
        return total

    def clip_and_step(self, max_norm: float) -> float | None:
        return self.mem.clip_and_step(max_norm)

    def global_loss(self, local: torch.Tensor) -> float:
        return local.item()

    def evaluate(self, batches) -> float:
        return evaluate(self.model, batches, self.device, self.autocast)

    def signature_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.mem.named_shapes()

    def checkpoint_groups(self, hand_over: bool = False):
        from tightfit.train.checkpoint_swap import state_groups

        return state_groups(self.model, self.optimizer, hand_over=hand_over)

    def export_hf(self, folder: str, meta_model: Callable[[], torch.nn.Module], check_finite: bool = False,
                  merge_lora: bool = False) -> None:
        """Write the trained model as a Hugging Face folder, streamed from wherever its weights live. `check_finite`:
        raise NonFiniteWeight for a NaN or infinite weight (the export is then not written): a run exports before
        its last save, which would have refused such a state. A LoRA fine-tune writes its adapter in peft's layout,
        or with `merge_lora` the base model with the adapters merged in (`meta_model` builds the base)."""
        from tightfit.models.hf_save import save_hf_model
        from tightfit.train.checkpoint_writer import non_finite_in

        def checked():
            for key, t in self.export_tensors():
                bad = non_finite_in(t) if check_finite and key.startswith("model.") else None
                if bad:
                    raise NonFiniteWeight(key, bad)
                yield key, t

        from tightfit.finetune import lora

        config = lora.peft_config_of(self.model)
        if config is None:
            save_hf_model(self.model, folder, tensors=checked(), strip_prefix="model.")
        elif merge_lora:  # the base model's folder, each adapter merged into its weight
            save_hf_model(meta_model(), folder, strip_prefix="model.",
                          tensors=lora.merged_tensors(checked(), config.lora_alpha / config.r))
        else:  # the adapter, as peft saves it
            lora.save_adapter(folder, config, lora.adapter_tensors(checked()))

    def export_tensors(self):
        """(key, CPU tensor) of the model's values and its optimizer's state (state_io's keys), as an export reads
        them."""
        return self.mem.export_state()

    def memory_in_use(self) -> dict[str, int]:
        return self.mem.memory_in_use()

    def engine_counters(self):
        return self.mem.engine_counters()

    def peak_memory(self) -> dict[str, int]:
        return self.mem.peak_memory()

    def compare_with_plan(self, step_seconds: float) -> str | None:
        return self.mem.compare_with_plan(step_seconds)

    def plan_record(self, step_seconds: float, run_seconds_per_step: float) -> dict | None:
        return self.mem.plan_record(step_seconds, run_seconds_per_step)

    def summary_fields(self) -> dict:
        return {}

    def close(self) -> None:
        """Stop the engine's threads and remove its swap files (idempotent)."""
        self.mem.close()


def streams_weights(cfg) -> bool:
    """An offloaded Hugging Face model is built on the meta device, its weights streamed into their tiers (with
    --lora, the base's under peft's names: finetune/lora.py `lora_values`)."""
    from tightfit.models.build import hf_path

    return hf_path(cfg.model.model) is not None and cfg.memory.offload != "none"


def one_process(model: torch.nn.Module, cfg, device: torch.device, dtype: torch.dtype, resume,
                planned: Callable | None, say: Callable[[str], None], averaging=None) -> OneProcess:
    """`model` held as `cfg` says (`setup_memory`), with the resumed state or a streamed model's weights in it.
    `averaging`: the model is one rank's replica (tightfit/parallel/replicas.py), its plan priced so."""
    from tightfit.models.build import hf_path

    # Planning measures this process's memory floor (it builds and steps a small model): with torch's global RNG
    # of its own, so the run draws what a plain run draws, whatever the placement (a checkpoint's RNG state was the
    # offload mode's before).
    shapes = {n: p.shape for n, p in model.named_parameters()}  # as built, before the engine holds them
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        mem = setup_memory(model, cfg, device, dtype, planned=planned, averaging=averaging, say=say)
    trainee = OneProcess(mem, device, dtype)
    try:
        if resume is not None:
            trainee.mem.import_state(resume.get)
        elif streams_weights(cfg):  # built on the meta device
            say(f"setup: filling the tiers from {hf_path(cfg.model.model)} one unit at a time")
            from tightfit.models.hf_load import HFCheckpoint
            from tightfit.models.hf_wrap import checkpoint_values

            with checkpoint_values(HFCheckpoint.open(hf_path(cfg.model.model))) as get:
                if cfg.model.lora:  # the base's weights under peft's names, the adapters' initial values
                    from tightfit.finetune.lora import lora_values

                    get = lora_values(get, shapes, cfg.train.seed)
                trainee.mem.import_state(get)
    except BaseException:
        trainee.close()
        raise
    return trainee
