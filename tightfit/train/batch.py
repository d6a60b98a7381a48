"""One micro-batch as the loop hands it to a trainee, and the loss it contributes to its step.

Why a type: a text corpus's batch is two tensors, inputs and next-token targets, every target trained on, and a
micro-batch's loss is its mean divided by the step's micro-batches. A fine-tuning batch is more: targets that carry
no loss (a prompt, padding, the first token of each example packed into a row: `IGNORE`), positions that restart
at each packed example (so attention stays inside it), and a loss normalised by the tokens that carry loss in the
whole step, every micro-batch and every rank together: the sum of the token losses times `per_token`. That is how
Hugging Face's Trainer counts (`num_items_in_batch`), so a step's loss and gradients are those of one batch of all
its answer tokens, whatever the micro-batch split; the mean of micro-batch means would weigh an answer token more
in a micro-batch with fewer of them. A text batch is a plain `(inputs, targets)` pair; `as_batch` reads both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tightfit.models.build import model_logits, model_loss

IGNORE = -100
"""A target that carries no loss (F.cross_entropy's and Hugging Face's ignore index)."""


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T] int64 token ids
    targets: torch.Tensor  # [B, T] int64: the next token, or IGNORE
    positions: torch.Tensor | None = None  # [B, T] int64, restarting at 0 at each packed example; None: 0..T-1
    per_token: float | None = None
    """The loss is sum(token losses) x per_token (1 / the step's loss tokens, x the data ranks whose gradients are
    averaged); None: the mean over the batch's targets, divided by the step's micro-batches."""

    @property
    def loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


def as_batch(item) -> Batch:
    """A Batch, from a Batch or a text corpus's (inputs, targets) pair."""
    return item if isinstance(item, Batch) else Batch(item[0], item[1])


def batch_loss(model: torch.nn.Module, batch: Batch, device: torch.device, micro_batches: int) -> torch.Tensor:
    """The loss `batch` contributes to its step, in fp32 (see the module's docstring)."""
    x, y = batch.inputs.to(device), batch.targets.to(device)
    if batch.per_token is None:
        return model_loss(model, x, y) / micro_batches
    positions = None if batch.positions is None else batch.positions.to(device)
    logits = model_logits(model, x, positions)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    return loss * batch.per_token
