"""LoRA from the command line: `--lora r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj`.

Why peft: the adapters a user trains here should load where they run the model, with
`PeftModel.from_pretrained(base, folder)`; peft's own layers on the model make the layout peft's. tightfit's part is
what peft leaves to the trainer: the frozen base held once in the compute dtype on whichever tier the plan gives it
(no master, gradient or moments for it: the engine keeps those for trainable parameters only), and the export.
- `add_lora`: the adapters on the model (on the meta device too: a base larger than RAM is streamed into its tiers
  as any model is, `lora_values`), initialised from the run's seed by `initial_value` (the same adapters for the
  same seed; a test builds them with peft and `initialise`).
- `adapter_tensors`: the trained model's state as peft saves an adapter (`adapter_model.safetensors`, keys without
  the adapter's name), written with `adapter_config.json` by `save_adapter`.
- `merged_tensors`: the base's weights with each adapter merged in, W + (alpha / r) B A, under the base model's own
  names: a plain Hugging Face folder (`--merge-lora`).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tightfit.errors import UsageError

_KEYS = ("r", "alpha", "dropout", "targets")
ADAPTER = "default"
"""peft's name for the one adapter tightfit trains."""


def parse_lora(spec: str) -> dict:
    """`r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj` as peft.LoraConfig's arguments. A bare name after
    targets= continues the list of targets."""
    out: dict = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
    key = None
    targets: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" not in part:
            if key != "targets":
                raise UsageError(f"--lora: cannot read {part!r}; give key=value pairs from {', '.join(_KEYS)}, e.g. "
                                 "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj")
            targets.append(part)
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        try:
            if key == "r":
                out["r"] = int(value)
                if out["r"] <= 0:
                    raise ValueError
            elif key == "alpha":
                out["lora_alpha"] = float(value)
                if not out["lora_alpha"] > 0:
                    raise ValueError
            elif key == "dropout":
                out["lora_dropout"] = float(value)
                if not 0.0 <= out["lora_dropout"] < 1.0:
                    raise ValueError
            elif key == "targets":
                targets.append(value)
            else:
                raise UsageError(f"--lora: unknown key {key!r}; the keys are {', '.join(_KEYS)}")
        except ValueError:
            raise UsageError(f"--lora: {key}={value!r} is not valid (r: a positive integer, alpha: a positive number, "
                             "dropout: a number in [0, 1))") from None
    if targets:
        out["target_modules"] = targets if targets != ["all-linear"] else "all-linear"
    if float(out["lora_alpha"]).is_integer():
        out["lora_alpha"] = int(out["lora_alpha"])
    return out


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError("--lora: needs peft; pip install 'tightfit[hf]'") from None
    return peft


def add_lora(model: torch.nn.Module, spec: str, seed: int, base: str = "") -> torch.nn.Module:
    """`model` with LoRA adapters (peft), the base frozen, the adapters at their initial values (`initial_value`)
    where the model is real; a model on the meta device gets them from `lora_values` with the rest of its state.
    `base`: what the adapter's config names as its base model (the --model folder)."""
    from tightfit.models.build import is_hf_model

    if not is_hf_model(model):
        raise UsageError("--lora: needs a Hugging Face model (--model hf:PATH); the reference GPT trains whole")
    peft = _peft()
    config = peft.LoraConfig(task_type="CAUSAL_LM", **parse_lora(spec))
    with torch.random.fork_rng():  # peft's own draws (overwritten below) leave the run's RNG as it was
        try:
            model = peft.get_peft_model(model, config)
        except ValueError as e:  # a target the model does not have
            raise UsageError(f"--lora: {str(e).splitlines()[0][:160]}") from None
    model.peft_config[ADAPTER].base_model_name_or_path = base  # get_peft_model sets it from the model's config
    for name, p in model.named_parameters():
        if p.requires_grad:
            if not name.endswith((f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight")):
                raise UsageError(f"--lora: {name} is an adapter tensor tightfit does not initialise (LoRA on "
                                 "nn.Linear layers only); choose linear targets")
            if p.device.type != "meta":
                with torch.no_grad():
                    p.copy_(initial_value(name, p.shape, seed))
    return model


def initial_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """A LoRA tensor's initial value: peft's default distribution (A kaiming-uniform with a = sqrt(5), that is
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)); B zero), drawn from a generator of its own seeded by the run's seed and the
    tensor's name, so that a model built on the meta device, and a test building the same adapters with peft, get
    the same values without replaying peft's draws."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) % (1 << 62))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def initialise(model: torch.nn.Module, seed: int) -> None:
    """Set a peft model's LoRA tensors to their initial values (`initial_value`): what `add_lora` does."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(initial_value(name, p.shape, seed))


def lora_values(get, shapes: dict[str, torch.Size], seed: int):
    """`get(key)` for a peft model's state built on the meta device (`shapes`: its parameters'): the adapters'
    initial values, and the base model's weights from `get` (a Hugging Face checkpoint's,
    `hf_wrap.checkpoint_values`) under their own names."""
    inner = "model.base_model.model."

    def lookup(key: str) -> torch.Tensor:
        if ".lora_" in key:
            name = key.removeprefix("model.")
            return initial_value(name, shapes[name], seed)
        if key.startswith(inner):
            return get("model." + key[len(inner):].replace(".base_layer.", "."))
        return get(key)

    return lookup


def peft_config_of(model: torch.nn.Module):
    """The model's LoRA config when it is a peft model, else None."""
    configs = getattr(model, "peft_config", None)
    return None if not configs else configs[ADAPTER]


def _module_of(name: str, part: str) -> str:
    """`...q_proj.lora_A.default.weight` -> `...q_proj` for part `.lora_A`."""
    return name[:name.index(part)]


def adapter_tensors(state: Iterable[tuple[str, torch.Tensor]], prefix: str = "model.") \
        -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors of a peft model's state (`prefix` + parameter name), named as peft saves them."""
    for key, t in state:
        name = key[len(prefix):] if key.startswith(prefix) else key
        if ".lora_" in name:
            yield name.replace(f".{ADAPTER}.", "."), t


def save_adapter(folder: str | Path, config, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`folder` as `PeftModel.save_pretrained` writes it: adapter_model.safetensors and adapter_config.json, each
    written to a temporary name and renamed."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: t.detach().to("cpu").contiguous() for k, t in tensors}
    if not weights:
        raise UsageError("--export-hf: the model has no LoRA tensors to save")
    tmp = folder / ".adapter_model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / "adapter_model.safetensors")
    d = config.to_dict()
    d = {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}
    tmp = folder / ".adapter_config.json.tmp"
    tmp.write_text(json.dumps(d, indent=2, default=str))
    os.replace(tmp, folder / "adapter_config.json")


def merged_tensors(state: Iterable[tuple[str, torch.Tensor]], scale: float, prefix: str = "model.") \
        -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors, each adapted weight with W + scale B A merged in, under the base's names
    (`prefix` + name, the adapters themselves left out). A weight waits for its A and B where they come later
    (the state comes a unit at a time: they are near)."""
    inner = "base_model.model."
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def base_name(name: str) -> str:
        return name[len(inner):] if name.startswith(inner) else name

    for key, t in state:
        name = key[len(prefix):] if key.startswith(prefix) else key
        for part in (".base_layer.weight", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"):
            if name.endswith(part):
                module = _module_of(name, part)
                got = pending.setdefault(module, {})
                got[part.split(".")[1]] = t
                if len(got) == 3:
                    del pending[module]
                    w = got["base_layer"]
                    delta = (got["lora_B"].float() @ got["lora_A"].float()) * scale
                    yield prefix + base_name(module) + ".weight", (w.float() + delta).to(w.dtype)
                break
        else:
            if ".lora_" in name:
                continue  # an adapter's other tensors (dropout has none): nothing to merge
            yield prefix + base_name(name.replace(".base_layer.", ".")), t
    if pending:
        raise UsageError(f"--merge-lora: {next(iter(pending))} lacks its base weight or an adapter matrix")
