"""Training checkpoints as one safetensors file: weights, optimizer state, step, RNG states, data position, config.

Why one safetensors file: it opens with any safetensors reader (no pickle, so a checkpoint from someone else
cannot run code), tensors stream in and out one at a time (offloaded models never gather in RAM), and the
non-tensor facts (step, config, tightfit version, the model's parameter signature) ride in the header's string
metadata. Tensor keys are the same for plain and offloaded runs ("model.<param>", "optim.<param>.exp_avg", ...),
so a checkpoint written with one placement resumes under another.

Resume is bit-exact: the model and optimizer tensors, torch's RNG state and the data generator's state (the data
position) are restored, and the learning-rate schedule is a pure function of the step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from tightfit import __version__
from tightfit.errors import UsageError
from tightfit.utils.safetensors_io import StreamingWriter, open_checked

FORMAT = "tightfit-checkpoint/1"
CHECKPOINT_NAME = "checkpoint.safetensors"
RNG_TORCH = "rng.torch"
RNG_DATA = "rng.data"
RNG_CUDA = "rng.cuda"


def model_signature(named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """A short hash of parameter names and shapes: equal iff the checkpoint fits the model."""
    h = hashlib.sha256()
    for name, shape in sorted(named_shapes):
        h.update(f"{name}:{list(shape)};".encode())
    return h.hexdigest()[:16]


@dataclass
class Checkpoint:
    """An opened checkpoint: its metadata, and its tensors read on demand."""

    path: Path
    step: int
    config: dict
    signature: str
    shapes: dict[str, list[int]]
    _handle: object

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; KeyError when absent (state_io decides whether that is an error, e.g. a checkpoint
        saved without optimizer moments resumes with fresh ones)."""
        if name not in self.shapes:
            raise KeyError(name)
        return self._handle.get_tensor(name)

    def rng_states(self) -> dict[str, torch.Tensor]:
        return {k: self.get(k) for k in (RNG_TORCH, RNG_DATA, RNG_CUDA) if k in self.shapes}


def save_checkpoint(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, step: int, config: dict,
                    signature: str, rng: dict[str, torch.Tensor]) -> Path:
    """Write atomically: the previous checkpoint at `path` survives any failure."""
    with StreamingWriter(path, flag="--out-dir") as w:
        for name, t in tensors:
            w.add(name, t)
        for name, t in rng.items():
            w.add(name, t)
        return w.close({"format": FORMAT, "step": str(step), "config": json.dumps(config),
                        "signature": signature, "tightfit_version": __version__})


def load_checkpoint(path: Path, flag: str = "--resume") -> Checkpoint:
    handle = open_checked(path, flag, "checkpoint")
    meta = handle.metadata() or {}
    if meta.get("format") != FORMAT:
        raise UsageError(f"{flag}: {path} is a safetensors file but not a tightfit checkpoint "
                         f"(format {meta.get('format')!r}); point --out-dir at a tightfit run")
    try:
        step = int(meta["step"])
        config = json.loads(meta["config"])
    except (KeyError, ValueError):
        raise UsageError(f"{flag}: {path} has damaged metadata; use another checkpoint") from None
    shapes = {k: list(handle.get_slice(k).get_shape()) for k in handle.keys()}
    return Checkpoint(path=path, step=step, config=config, signature=meta.get("signature", ""), shapes=shapes,
                      _handle=handle)


def check_compatible(ckpt: Checkpoint, named_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    """Refuse a checkpoint whose parameters do not match the model, naming the first difference."""
    if ckpt.signature == model_signature(named_shapes):
        return
    ours = {f"model.{n}": list(s) for n, s in named_shapes}
    theirs = {k: v for k, v in ckpt.shapes.items() if k.startswith("model.")}
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise UsageError(
                f"--resume: {ckpt.path} was written by a different model ({name[6:]}: checkpoint "
                f"{theirs.get(name, 'absent')}, model {ours.get(name, 'absent')}); use the same model flags "
                "or another --out-dir")
    raise UsageError(f"--resume: {ckpt.path} does not match this model; use another --out-dir")


def capture_rng(data_generator: torch.Generator) -> dict[str, torch.Tensor]:
    rng = {RNG_TORCH: torch.get_rng_state(), RNG_DATA: data_generator.get_state()}
    if torch.cuda.is_available():
        rng[RNG_CUDA] = torch.cuda.get_rng_state()
    return rng


def restore_rng(states: dict[str, torch.Tensor], data_generator: torch.Generator) -> None:
    torch.set_rng_state(states[RNG_TORCH])
    data_generator.set_state(states[RNG_DATA])
    if RNG_CUDA in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[RNG_CUDA])


StateGetter = Callable[[str], torch.Tensor]
