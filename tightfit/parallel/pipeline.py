"""Pipeline parallelism over the mesh's `pp` dimension: cut the model at block boundaries, run GPipe or 1F1B.

Why block boundaries: a transformer block is the unit everything else in tightfit already uses (offload units,
FSDP groups); between two blocks the only live tensor is the residual stream [mb, T, C], which is all a stage sends
to the next one.

Balancing: stages are contiguous runs of blocks, chosen to minimise the most expensive stage (the pipeline runs at
the pace of its slowest stage). A unit's cost is the number of weights it multiplies per token — FLOPs are 6× that
per token in training — so a block costs its Linear weights, the LM head costs vocab × C (often several blocks'
worth), and embedding lookups cost nothing. The first stage also holds the embeddings and the last the final norm
and head.

Schedules come from `torch.distributed.pipelining`: GPipe runs every micro-batch's forward, then every backward
(m micro-batches of activations live at once); 1F1B alternates after a warm-up (at most `pp` in flight). Both
have the same bubble, (p − 1)/(m + p − 1) of the step. Gradients are averaged over micro-batches by the schedule
(`scale_grads`), so a step equals one step on the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from tightfit.errors import UsageError


def unit_cost(module: nn.Module) -> int:
    """Weights multiplied per token: Linear/Conv1D weight elements (embeddings are lookups: free)."""
    return sum(m.weight.numel() for m in module.modules()
               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


def balance(costs: list[float], stages: int) -> list[list[int]]:
    """Split indices 0..n-1 into `stages` contiguous non-empty runs minimising the largest run's cost.

    Exact dynamic programme, O(stages · n²): n is the number of blocks (tens), so this is instant.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise UsageError(f"--pp {stages}: need between 1 and {n} stages (one block at least per stage)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i units into s stages; cut[s][i]: where the last one starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    runs, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        runs.append(list(range(j, i)))
        i = j
    return runs[::-1]


class GPTStage(nn.Module):
    """One pipeline stage of the reference GPT. Parameter names match the full model's ("blocks.3.mlp.up.weight"),
    so checkpoints and weight comparisons need no renaming.

    forward: first stage takes token ids [mb, T] (int64); others take the residual stream [mb, T, C]; the last
    returns logits [mb, T, vocab], the others the residual stream.
    """

    def __init__(self, gpt: nn.Module, block_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in block_ids})
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # [mb, T, C]
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def split_stages(model: nn.Module, pp: int) -> list[list[int]]:
    """Block indices of each stage, balanced by cost (head cost charged to the last block, see module doc)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not all(hasattr(model, a) for a in ("tok_emb", "ln_f", "head")):
        raise UsageError("pipeline parallelism: supported for the reference GPT (tok_emb, blocks, ln_f, head); "
                         "for Hugging Face models use zero3 or tp")
    costs = [float(unit_cost(b)) for b in blocks]
    costs[-1] += unit_cost(model.head)
    return balance(costs, pp)


def build_stage_module(model: nn.Module, pp_rank: int, pp: int) -> GPTStage:
    """The part of `model` that pipeline rank `pp_rank` runs (other blocks are simply not referenced)."""
    runs = split_stages(model, pp)
    return GPTStage(model, runs[pp_rank], first=pp_rank == 0, last=pp_rank == pp - 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: the same loss GPT.forward(idx, targets) computes."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def apply_pp(stage_module: nn.Module, pp_mesh: DeviceMesh, device: torch.device, schedule: str,
             microbatches: int, loss_fn=lm_loss):
    """Wrap this rank's (already TP/DP-parallelised) stage module in a PipelineStage and a schedule.

    Returns the schedule: call `step(x)` on the first stage, `step(target=y, losses=out)` on the last, `step()`
    between. Data parallelism applied to `stage_module` before this call (DDP or FSDP) is recognised by the stage,
    which skips gradient sync on all but the last micro-batch's backward.
    """
    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    stage = PipelineStage(stage_module, pp_rank, pp, device, group=pp_mesh.get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
    if cls is None:
        raise UsageError(f"--pp-schedule: {schedule!r} is not one of gpipe, 1f1b")
    return cls(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
