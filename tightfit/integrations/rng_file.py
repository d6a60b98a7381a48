"""The process's random number generators as one safetensors file (Trainer's rng_state.pth is a pickle).

Why: a resumed run must draw the same dropout masks and shuffles as an unbroken one, and a checkpoint is read
without running code from it. Python's and NumPy's Mersenne Twister states are 624 32-bit words plus a position
and a cached Gaussian; the words go in as int64 tensors, the scalars in the header's metadata as JSON. torch's
CPU (and CUDA, where present) states are byte tensors already.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from tightfit.errors import UsageError
from tightfit.utils.safetensors_io import StreamingWriter, open_checked

RNG_FILE = "rng_state.safetensors"
FORMAT = "tightfit-rng/1"


def save_rng(path: Path) -> Path:
    """Write the current Python, NumPy and torch RNG states to `path`, atomically."""
    version, words, gauss = random.getstate()
    kind, np_words, pos, has_gauss, cached = np.random.get_state()
    scalars = {"python_version": version, "python_gauss": gauss, "numpy_kind": kind, "numpy_pos": int(pos),
               "numpy_has_gauss": int(has_gauss), "numpy_cached_gaussian": float(cached)}
    with StreamingWriter(path, flag="output_dir") as w:
        w.add("python", torch.tensor(words, dtype=torch.int64))
        w.add("numpy", torch.from_numpy(np_words.astype(np.int64)))
        w.add("torch", torch.random.get_rng_state())
        if torch.cuda.is_available():
            w.add("cuda", torch.cuda.get_rng_state())
        return w.close({"format": FORMAT, "scalars": json.dumps(scalars)})


def load_rng(path: Path) -> None:
    """Restore what `save_rng` wrote (the CUDA state only where this process has a GPU)."""
    handle = open_checked(path, "resume_from_checkpoint", "RNG state file")
    meta = handle.metadata() or {}
    if meta.get("format") != FORMAT:
        raise UsageError(f"resume_from_checkpoint: {path} is not a tightfit RNG state file; resume from a checkpoint "
                         "written by TightfitTrainer")
    s = json.loads(meta["scalars"])
    words = tuple(int(x) for x in handle.get_tensor("python").tolist())
    random.setstate((s["python_version"], words, s["python_gauss"]))
    np.random.set_state((s["numpy_kind"], handle.get_tensor("numpy").numpy().astype(np.uint32), s["numpy_pos"],
                         s["numpy_has_gauss"], s["numpy_cached_gaussian"]))
    torch.random.set_rng_state(handle.get_tensor("torch"))
    if torch.cuda.is_available() and "cuda" in set(handle.keys()):
        torch.cuda.set_rng_state(handle.get_tensor("cuda"))
