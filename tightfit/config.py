"""Typed configuration: one dataclass per component, CLI flags and TOML sections built from them.

Why: a setting is declared once, with its type, default and help text (the attribute docstring-style `help`
metadata). The CLI (`--micro-batch 8`), the TOML file (`[train] micro_batch = 8`) and the checkpoint's saved
config all derive from the same field, and every error names the flag the user typed.

Precedence: dataclass defaults < `--config FILE.toml` < command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from tightfit.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _f(default, help: str, choices: tuple | None = None):
    """A dataclass field with help text (and optional choices) for its CLI flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    model: str = _f("gpt", "model to train: 'gpt' (the reference GPT) or 'hf:PATH' (a local Hugging Face folder)")
    n_layer: int = _f(4, "reference GPT: number of transformer blocks")
    n_head: int = _f(4, "reference GPT: attention heads")
    n_embd: int = _f(128, "reference GPT: residual width")
    tokenizer: str | None = _f(None, "local Hugging Face tokenizer folder; for records, the --model hf:DIR folder's "
                                     "own when it has one (default: byte-level tokens, vocab 256)")
    lora: str | None = _f(None, "train LoRA adapters (peft) on a frozen base, e.g. r=16,alpha=32,dropout=0.05,"
                                "targets=q_proj,k_proj,v_proj,o_proj (default: off; a key left out is r=16, alpha=32, "
                                "dropout=0, targets=all-linear)")


@dataclass
class DataConfig:
    data: str | None = _f(None, "text file or folder of text files; or records: a .jsonl or .parquet file, a "
                                "folder of them, a datasets.save_to_disk folder (default: the Python standard "
                                "library's source)")
    val_fraction: float = _f(0.05, "fraction held out for validation: of a corpus's blocks, or of the records")
    val_data: str | None = _f(None, "held-out records (as --data), instead of a --val-fraction of --data's")
    data_format: str = _f("auto", "what the records are (auto: read off the first record's fields)",
                          ("auto", "text", "prompt-completion", "messages"))
    chat_template: str | None = _f(None, "Jinja file rendering messages records (default: the tokenizer's own)")
    train_on_prompt: bool = _f(False, "records: train on every token, not only the completion or the assistant's "
                                      "turns")
    packing: bool = _f(True, "records: fill each row of --seq-len with whole examples, attention within each "
                             "(--no-packing: one example a row, padded to the longest in the micro-batch)")
    truncate: bool = _f(True, "records: cut an example longer than --seq-len to it, counting them "
                              "(--no-truncate: refuse such an example)")
    skip_bad_records: bool = _f(False, "records: skip a record that cannot be trained on, counting them, instead "
                                       "of stopping at it")


@dataclass
class OptimConfig:
    lr: float = _f(4e-3, "peak learning rate")
    min_lr: float = _f(4e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(100, "linear warm-up steps")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (matrices only; biases, norms exempt)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value (0 disables clipping)")


@dataclass
class TrainConfig:
    steps: int = _f(1500, "optimizer steps to train")
    micro_batch: int = _f(16, "sequences per micro-batch")
    seq_len: int = _f(128, "tokens per sequence")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    eval_interval: int = _f(250, "evaluate every N steps (and at the end)")
    eval_batches: int = _f(8, "held-out batches per evaluation (fixed, the same every time)")
    log_interval: int = _f(50, "print progress every N steps")
    save_interval: int = _f(0, "write a checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(1, "checkpoints kept in --out-dir/checkpoints, the newest (an old one is removed only "
                                  "after a new one is committed); 0: write none (a benchmark, a throwaway run)")
    out_dir: str = _f("runs/default", "folder for checkpoints and metrics.jsonl")
    resume: bool = _f(False, "continue from the checkpoint in --out-dir")
    save_on_signal: bool = _f(True, "on SIGTERM, SIGHUP or SIGINT, stop at the end of the step with a checkpoint "
                                    "(--no-save-on-signal: stop without one; a save in flight still completes)")
    resume_step: int = _f(0, "with --resume: the step of the checkpoint to continue from (0: the newest); the "
                             "newer ones are removed when this run commits its first checkpoint")
    export_hf: str | None = _f(None, "at the end, also save the model to this folder in the Hugging Face layout "
                                     "(with --lora: the adapter, in peft's layout)")
    merge_lora: bool = _f(False, "with --lora and --export-hf: export the base with the adapters merged into it")
    max_time: float = _f(0.0, "stop after this many seconds of training (0: no limit)")
    stop_at: int = _f(0, "stop with a checkpoint after this step, keeping the schedule of --steps (0: run to --steps)")
    seed: int = _f(1337, "random seed (model init, data order)")
    device: str = _f("auto", "where to compute", ("auto", "cpu", "cuda"))
    precision: str = _f("auto", "compute precision (auto: bf16 on CUDA, fp32 on CPU)", ("auto", "fp32", "bf16", "fp16"))
    threads: int = _f(0, "CPU threads for torch (0: torch's default; more than the machine's cores are capped "
                         "at them, with a notice)")
    tensorboard: str = _f("auto", "metrics to TensorBoard in --out-dir/tensorboard (auto: when it is installed)",
                          ("auto", "on", "off"))
    profile: str | None = _f(None, "write a measured Chrome trace of 3 real steps (torch.profiler, with the engine's "
                                   "copies and disk I/O) to this folder, beside the plan's simulated one")
    plot: bool = _f(False, "at the end, draw run.png in --out-dir: loss and memory per tier over the run (matplotlib)")


@dataclass
class MemoryConfig:
    gpu_mem: str | None = _f(None, "device memory budget, e.g. 8GiB (default: what the device has, less headroom)")
    cpu_mem: str | None = _f(None, "host memory budget, e.g. 16GiB (default: available RAM, less headroom); "
                                   "without a GPU it bounds the whole process")
    nvme: str | None = _f(None, "swap folder for the NVMe tier, optionally with a size: PATH[:SIZE]")
    offload: str = _f("auto", "offload: auto (planner decides; plain PyTorch in fp32 where nothing would move), none "
                              "(plain PyTorch, no plan), or a tier for every state (the offload engine)",
                      ("auto", "none", "device", "host", "nvme"))
    checkpointing: str = _f("auto", "activation checkpointing: of the units the plan picks (one process, the engine "
                                    "on each rank), or of every block under ddp/zero/tp/pp (auto: where a rank's "
                                    "estimate outgrows its GPU)", ("auto", "on", "off"))
    accumulation: str = _f("auto", "order of a step's micro-batches under offload: unit (each unit runs every "
                                   "micro-batch before the next: its params cross once a step and its gradients are "
                                   "summed on the device), micro (each micro-batch's forward and backward before the "
                                   "next), auto (the planner's choice)", ("auto", "unit", "micro"))
    boundaries: str = _f("auto", "where unit-major order keeps each micro-batch's block inputs until their backward: "
                                 "device, host (page-locked host memory, crossing the link twice a step), or auto "
                                 "(host where the device cannot hold them; on a GPU)", ("auto", "device", "host"))
    trace: str | None = _f(None, "write a Chrome trace and memory timeline of one step to this folder")


@dataclass
class ParallelConfig:
    nproc_per_node: int = _f(1, "processes (GPUs) per node; >1 launches through torch.distributed")
    nnodes: int = _f(1, "number of nodes")
    node_rank: int = _f(0, "this node's rank")
    master_addr: str = _f("127.0.0.1", "address of the rank-0 node")
    master_port: int = _f(29500, "port of the rank-0 node")
    strategy: str = _f("auto", "scale-out strategy: auto, or tokens dp|ddp|zero1|zero2|zero3, pp, tp joined by '_' "
                                "(e.g. ddp, zero3, tp, pp, dp_tp, dp_pp, pp_tp, dp_pp_tp, zero1_pp_tp); with "
                                "--offload host|nvme, ddp, zero1, zero2 and zero3 run the offload engine on each "
                                "rank (zero1: each rank holds the optimizer states of its own units; zero2: and "
                                "their gradients; zero3: and their parameters, sent for each use, or with --offload "
                                "host FSDP2's shards in host memory where the plan finds that faster: "
                                "--zero3-params); zero3 with "
                                "--offload auto is FSDP2's, its states on the host where its shards do not fit "
                                "the GPUs (the AdamW moments past the host's room on --nvme)")
    zero3_params: str = _f("auto", "with --strategy zero3 and --offload host|nvme, how each unit's parameters reach "
                                   "the ranks: fsdp2 (FSDP2's all-gather of every rank's shard from its host memory, "
                                   "for each micro-batch), exchange (the offload engine: each unit's owner holds its "
                                   "states, on NVMe too, and broadcasts its parameters for each use), auto (the "
                                   "faster by the plan under --offload host; the exchange under --offload nvme)",
                           ("auto", "fsdp2", "exchange"))
    interconnect: str = _f("auto", "interconnect between the GPUs, for what-if planning (its assumed bandwidth); "
                                   "in a run of the engine on each rank, pcie: its all-reduce shares the offload's "
                                   "lanes",
                           ("auto", "nvlink", "pcie", "infiniband", "ethernet"))
    tp: int = _f(0, "tensor-parallel degree (0: chosen by the strategy)")
    pp: int = _f(0, "pipeline-parallel degree (0: chosen by the strategy)")
    pp_schedule: str = _f("1f1b", "pipeline schedule", ("gpipe", "1f1b"))
    pp_microbatches: int = _f(4, "pipeline micro-batches per step")
    dist_timeout: float = _f(120.0, "seconds a rank waits in a collective for the others before it stops with "
                                    "one line naming the collective")


@dataclass
class Config:
    """Everything `tightfit train` and `tightfit plan` read."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "Config":
        cfg = cls()
        _apply(cfg, d, source)
        return cfg


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp) -> type:
    """int for `int`, str for `str | None`, and so on."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _coerce(value, tp: type, flag: str):
    """`value` (a flag's string, or a TOML value) as `tp`. Refused rather than bent: a TOML boolean or a
    fractional number for an integer, and a NaN or infinite float (no setting means anything with one)."""
    if tp is not bool and isinstance(value, bool):
        raise UsageError(f"{flag}: expected {tp.__name__}, got {value!r}")
    if tp is int and isinstance(value, float) and not value.is_integer():
        raise UsageError(f"{flag}: expected an integer, got {value!r}")
    if tp is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{flag}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise UsageError(f"{flag}: must be a finite number, got {value!r}")
        return number
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"{flag}: expected true or false, got {value!r}")
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag}: expected {tp.__name__}, got {value!r}") from None


def _sections(cfg: Config):
    hints = typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        yield sec.name, getattr(cfg, sec.name), hints[sec.name]


def _set(obj, f: dataclasses.Field, value, flag: str) -> None:
    tp = _base_type(typing.get_type_hints(type(obj))[f.name])
    if value is None:
        setattr(obj, f.name, None)
        return
    value = _coerce(value, tp, flag)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"{flag}: {value!r} is not one of {', '.join(map(str, choices))}")
    setattr(obj, f.name, value)


def _apply(cfg: Config, d: dict, source: str) -> None:
    """Apply a nested dict ({section: {field: value}}), as read from TOML or a checkpoint."""
    sections = {name: obj for name, obj, _ in _sections(cfg)}
    for sec_name, values in d.items():
        if sec_name not in sections or not isinstance(values, dict):
            raise UsageError(f"{source}: unknown section [{sec_name}]; known: {', '.join(sections)}")
        obj = sections[sec_name]
        fields = {f.name: f for f in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in fields:
                raise UsageError(f"{source}: unknown setting {sec_name}.{key}")
            _set(obj, fields[key], value, f"{source}: {sec_name}.{key} ({flag_name(key)})")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (grouped by section), plus --config."""
    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file; flags override it")
    for sec_name, obj, _ in _sections(Config()):
        group = parser.add_argument_group(sec_name)
        for f in dataclasses.fields(obj):
            tp = _base_type(typing.get_type_hints(type(obj))[f.name])
            help_text = f.metadata.get("help", "")
            if "(default:" not in help_text:  # a help that says its default says it better than None
                help_text += f" (default: {'not set' if f.default is None else f.default})"
            if tp is bool:
                group.add_argument(flag_name(f.name), dest=f"{sec_name}.{f.name}", action="store_const",
                                   const=True, default=None, help=help_text)
                if f.default is True:  # a setting on by default is turned off by its --no- form
                    group.add_argument("--no-" + flag_name(f.name)[2:], dest=f"{sec_name}.{f.name}",
                                       action="store_const", const=False, default=None,
                                       help=f"turn {flag_name(f.name)} off")
            else:
                # Values stay strings here; _set converts and validates them so the error names the flag.
                group.add_argument(flag_name(f.name), dest=f"{sec_name}.{f.name}", default=None,
                                   metavar=tp.__name__.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then the TOML file named by --config, then flags."""
    cfg = Config()
    if getattr(args, "config", None):
        path = Path(args.config)
        if path.is_dir():
            raise UsageError(f"--config: {path} is a folder; give the TOML file itself")
        if not path.is_file():
            raise UsageError(f"--config: file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"--config: {path} is not valid TOML ({e})") from None
        _apply(cfg, data, f"--config {path}")
    for sec_name, obj, _ in _sections(cfg):
        for f in dataclasses.fields(obj):
            value = getattr(args, f"{sec_name}.{f.name}", None)
            if value is not None:
                _set(obj, f, value, flag_name(f.name))
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Range checks that a type alone cannot express; each error names its flag."""
    t, o = cfg.train, cfg.optim
    positive = {"steps": t.steps, "micro_batch": t.micro_batch, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
                "eval_interval": t.eval_interval, "eval_batches": t.eval_batches, "log_interval": t.log_interval,
                "n_layer": cfg.model.n_layer, "n_head": cfg.model.n_head, "n_embd": cfg.model.n_embd,
                "nproc_per_node": cfg.parallel.nproc_per_node, "nnodes": cfg.parallel.nnodes,
                "pp_microbatches": cfg.parallel.pp_microbatches}
    for name, value in positive.items():
        if value <= 0:
            raise UsageError(f"{flag_name(name)}: must be a positive integer, got {value}")
    non_negative = {"save_interval": t.save_interval, "keep_checkpoints": t.keep_checkpoints,
                    "warmup_steps": o.warmup_steps, "threads": t.threads, "max_time": t.max_time,
                    "stop_at": t.stop_at, "resume_step": t.resume_step, "grad_clip": o.grad_clip,
                    "weight_decay": o.weight_decay,
                    "tp": cfg.parallel.tp, "pp": cfg.parallel.pp}
    for name, value in non_negative.items():
        if value < 0:
            raise UsageError(f"{flag_name(name)}: must not be negative, got {value}")
    seeds = 2**63 // 1000003  # the data generator's seed is seed x 1000003 (train/data.py), a signed 64-bit integer
    if not 0 <= t.seed < seeds:
        raise UsageError(f"--seed: must be an integer from 0 to {seeds - 1:,}, got {t.seed}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise UsageError(f"{flag_name(name)}: must be in [0, 1), got {getattr(o, name)}")
    if cfg.memory.offload == "none":
        for name in ("nvme", "cpu_mem"):
            if getattr(cfg.memory, name) is not None:
                raise UsageError(f"{flag_name(name)}: has no effect with --offload none (plain PyTorch, every state "
                                 f"on the compute device); drop it, or use --offload auto to let it shape the plan")
    if t.resume_step and not t.resume:
        raise UsageError("--resume-step: chooses the checkpoint --resume continues from; add --resume")
    if t.keep_checkpoints == 0:
        for name, value in (("save_interval", t.save_interval), ("stop_at", t.stop_at), ("resume", t.resume)):
            if value:
                raise UsageError(f"{flag_name(name)}: needs checkpoints, and --keep-checkpoints 0 writes none; drop "
                                 "one of the two")
    if not cfg.parallel.dist_timeout > 0:
        raise UsageError(f"--dist-timeout: must be a positive number of seconds, got {cfg.parallel.dist_timeout}")
    if not (0.0 < o.lr < 10.0):
        raise UsageError(f"--lr: must be in (0, 10), got {o.lr}")
    if not (0.0 <= o.min_lr <= o.lr):
        raise UsageError(f"--min-lr: must be between 0 and --lr ({o.lr}), got {o.min_lr}")
    if not (0.0 < cfg.data.val_fraction < 0.5):
        raise UsageError(f"--val-fraction: must be in (0, 0.5), got {cfg.data.val_fraction}")
    _validate_finetune(cfg)
    if cfg.model.n_embd % cfg.model.n_head:
        raise UsageError(f"--n-head: must divide --n-embd ({cfg.model.n_embd}), got {cfg.model.n_head}")
    world = cfg.parallel.nproc_per_node * cfg.parallel.nnodes
    if cfg.parallel.strategy != "auto" and world > 1:
        from tightfit.parallel.plan import parse_strategy

        p = cfg.parallel
        parse_strategy(p.strategy, world, p.tp, p.pp, p.pp_schedule, p.pp_microbatches)
    elif cfg.parallel.strategy != "auto":  # one process runs no strategy, but a misspelt one is still an error
        from tightfit.parallel.plan import DP_MODES

        tokens = cfg.parallel.strategy.replace("+", "_").split("_")
        if not all(t in {"dp", "ddp", "pp", "tp", *DP_MODES} for t in tokens):
            raise UsageError(f"--strategy: cannot read {cfg.parallel.strategy!r}; use auto, or tokens dp, ddp, zero1, "
                             "zero2, zero3, pp, tp joined by '_' (e.g. dp_pp_tp, zero1_pp)")
    if cfg.parallel.zero3_params != "auto" and not (
            cfg.memory.offload in ("host", "nvme") and cfg.parallel.strategy == "zero3"
            and max(world, int(os.environ.get("WORLD_SIZE", "1"))) > 1):
        raise UsageError(f"--zero3-params {cfg.parallel.zero3_params}: chooses how --strategy zero3 with --offload "
                         "host|nvme moves the parameters on several processes; add those, or drop it")
    # Sizes are parsed here so a bad one fails before any work starts.
    from tightfit.utils.sizes import parse_size

    for name in ("gpu_mem", "cpu_mem"):
        value = getattr(cfg.memory, name)
        if value is not None:
            parse_size(value, flag_name(name))
    if cfg.memory.nvme is not None:
        parse_nvme(cfg.memory.nvme)
    if cfg.train.tensorboard == "on":
        from tightfit.train.tensorboard import require

        require()
    if cfg.train.plot:
        from tightfit.train.pictures import require as require_matplotlib

        require_matplotlib()


def _validate_finetune(cfg: Config) -> None:
    """The fine-tuning flags: records-only ones need records, --lora a Hugging Face model and peft."""
    from tightfit.finetune.records import is_records

    d = cfg.data
    records = is_records(d.data)
    if not records:
        for name, value, default in (("val_data", d.val_data, None), ("data_format", d.data_format, "auto"),
                                     ("chat_template", d.chat_template, None),
                                     ("train_on_prompt", d.train_on_prompt, False),
                                     ("skip_bad_records", d.skip_bad_records, False)):
            if value != default:
                raise UsageError(f"{flag_name(name)}: applies to records (--data a .jsonl or .parquet file, a folder "
                                 f"of them, or a datasets folder), and --data {d.data or '(the default corpus)'} is "
                                 "text; drop it or give records")
    elif d.val_data is not None and not is_records(d.val_data):
        raise UsageError(f"--val-data: {d.val_data} is not records (a .jsonl or .parquet file, a folder of them, "
                         "or a datasets folder)")
    if cfg.model.lora is not None:
        from tightfit.finetune.lora import parse_lora

        parse_lora(cfg.model.lora)
        if cfg.model.model == "gpt":
            raise UsageError("--lora: needs a Hugging Face model (--model hf:PATH); the reference GPT trains whole")
    if cfg.train.merge_lora and not (cfg.model.lora and cfg.train.export_hf):
        raise UsageError("--merge-lora: merges the adapters into the exported model; add --lora and --export-hf")


def compute_device_type(cfg: Config, cuda_available: bool) -> str:
    """'cuda' or 'cpu': --device, with auto meaning CUDA when there is one. The one statement of the rule."""
    if cfg.train.device == "auto":
        return "cuda" if cuda_available else "cpu"
    return cfg.train.device


def precision_name(cfg: Config, device_type: str) -> str:
    """'fp32', 'bf16' or 'fp16': --precision, with auto meaning bf16 on CUDA and fp32 on CPU."""
    p = cfg.train.precision
    if p == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return p


def parse_nvme(spec: str, flag: str = "--nvme") -> tuple[str, int | None]:
    """'PATH[:SIZE]' -> (path, bytes or None); errors name `flag` (the keyword `nvme` when called from Python)."""
    from tightfit.utils.sizes import parse_size

    path, sep, size = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not sep:
        path, size = spec, ""
    if not path:
        raise UsageError(f"{flag}: give a folder, optionally with a size: PATH[:SIZE]")
    return path, (parse_size(size, flag) if size else None)
