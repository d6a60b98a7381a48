"""A wrapped model's optimizer state as one safetensors file: what a framework's checkpoint stores for "the optimizer".

Why not `optimizer.state_dict()`: `tightfit.optim.AdamW` keeps nothing in `self.state` (the moments live in the
engine's tiers), and frameworks pickle that dict (Trainer's optimizer.pt); pickles are never written or read here.
The file streams from the tiers one tensor at a time (`state_io.export_state`), so it never gathers in memory, and
appears atomically (`StreamingWriter`).

Contents, for every trainable parameter (frozen ones never change, so they are not repeated here):
    model.<name>                  the fp32 master weights (the optimizer's copy: with bf16 compute the model's
                                  own weights are a rounded copy of it, so resuming from them would not be exact)
    optim.<name>.exp_avg / .exp_avg_sq / .step   Adam's state, as torch.optim.AdamW keeps it
and in the header's metadata the param groups' hyperparameters (lr, betas, eps, weight_decay, initial_lr, ...) with
the parameter names of each group, so a resume restores the learning rate the next step uses before the
scheduler's next `step()`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.offload.model_state.state_io import export_state, import_state
from tightfit.utils.safetensors_io import StreamingWriter, open_checked

OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT = "tightfit-optimizer/1"
_FLAG = "resume_from_checkpoint"


def _group_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of.get(id(p), "?") for p in group["params"]] for group in opt.param_groups]


def save_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, tensors=None) -> Path:
    """Write `opt`'s state over `model` (wrapped or plain) to `path`, atomically. `tensors`: the (key, tensor) pairs
    `export_state(..., trainable_only=True)` yields, from elsewhere (the ranks' gather of a sharded model)."""
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
              for group, names in zip(opt.param_groups, _group_names(model, opt))]
    with StreamingWriter(path, flag="output_dir") as w:
        for key, t in tensors if tensors is not None else export_state(model, opt, trainable_only=True):
            w.add(key, t)
        return w.close({"format": FORMAT, "param_groups": json.dumps(groups)})


def load_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    """Restore what `save_optimizer` wrote: masters and moments into the tiers, hyperparameters into `opt`."""
    handle = open_checked(path, _FLAG, "optimizer file")
    meta = handle.metadata() or {}
    if meta.get("format") != FORMAT:
        raise UsageError(f"{_FLAG}: {path} is not a tightfit optimizer file (format {meta.get('format')!r}); "
                         "resume from a checkpoint written by TightfitTrainer")
    saved = json.loads(meta["param_groups"])
    ours = _group_names(model, opt)
    if [g["params"] for g in saved] != ours:
        raise UsageError(f"{_FLAG}: {path} was written for other parameters or param groups than this model's "
                         "optimizer has (e.g. another model, or other parameters frozen); resume with the same setup")
    keys = set(handle.keys())

    def get(key: str) -> torch.Tensor:
        if key not in keys:
            raise KeyError(key)
        return handle.get_tensor(key)

    import_state(model, opt, get, trainable_only=True)
    for group, values in zip(opt.param_groups, saved):
        for k, v in values.items():
            if k != "params":
                group[k] = tuple(v) if isinstance(v, list) else v  # JSON turns the betas tuple into a list
