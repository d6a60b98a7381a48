"""How a training run holds its model: the object the loop asks to backward, clip, step, save and report memory.

Why an object and not flags: plain PyTorch and the offload engine differ in where tensors live, how gradients
are clipped and how state is exported, but the loop is the same. `setup_memory` picks the implementation once;
the loop never tests which one it has.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterator, Protocol

import psutil
import torch
import torch.nn as nn

from tightfit.config import Config


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices and embeddings, not biases or norm gains. Frozen parameters are left out."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _materialised(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` on `device`; parameters on the meta device (an offloadable Hugging Face model is built so: its
    weights are read into it afterwards) are allocated there empty, each once (tied weights stay tied), the real
    buffers (rotary tables) moved as they are."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    return model.to(device)


def check_buildable(n: int, cfg: Config, device_type: str) -> None:
    """Refuse, before a byte is allocated, a model whose construction alone cannot fit this machine's memory.

    The model is built on the CPU in fp32 before the planner places its states (4 bytes a parameter); with
    `--offload none` every state stays where it is computed (weights, gradients, two Adam moments: 16 bytes a
    parameter). The planner's full check comes after construction; this one keeps a reference model larger than RAM
    (`--n-embd 1048576`, `--seq-len 100000000`) from being allocated at all. `n`: the model's parameters."""
    from tightfit.errors import UsageError
    from tightfit.utils.sizes import format_size

    available = psutil.virtual_memory().available
    where = "this machine has available"
    limit = process_address_limit()
    if limit is not None and limit < available:  # `ulimit -v`: what this process may still map
        available, where = limit, f"this process may still allocate under its address-space limit (ulimit -v)"
    plain_cpu = cfg.memory.offload == "none" and device_type == "cpu"
    need = n * (16 if plain_cpu else 4)
    if need > available:
        what = "for its weights, gradients and Adam moments in fp32" if plain_cpu else "to build its fp32 weights"
        hf = cfg.model.model != "gpt"
        fix = ("use --offload auto (its states then go to the disk as needed) or a smaller model" if plain_cpu
               else "choose a smaller model" + ("" if hf else " (--n-layer, --n-embd, --seq-len)"))
        flag = "--model" if hf else "--n-embd/--n-layer/--seq-len"
        raise UsageError(f"{flag}: this model has {n:,} parameters and needs "
                         f"{format_size(need)} {what}, more than the {format_size(available)} of memory {where}; "
                         f"{fix}")


def process_address_limit() -> int | None:
    """Bytes this process may still map under RLIMIT_AS (`ulimit -v`), None without a limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - psutil.Process().memory_info().vms)


class MemorySetup(Protocol):
    """What the training loop needs from whatever holds the model's states."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def describe(self) -> str: ...
    def accumulate(self, forwards: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]: ...
    def backward(self, loss: torch.Tensor, last: bool = False) -> None: ...
    def clip_and_step(self, max_norm: float) -> float | None: ...
    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]: ...
    def export_state(self) -> Iterator[tuple[str, torch.Tensor]]: ...
    def import_state(self, get: Callable[[str], torch.Tensor]) -> None: ...
    def memory_in_use(self) -> dict[str, int]: ...
    def engine_counters(self) -> dict[str, float] | None: ...
    def close(self) -> None: ...
    def peak_memory(self) -> dict[str, int]: ...
    def compare_with_plan(self, step_seconds: float) -> str | None: ...
    def plan_record(self, step_seconds: float, run_seconds_per_step: float | None = None) -> dict | None: ...


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _rss_high_water() -> int:
    """The process's RSS high-water mark since it started (the kernel's VmHWM, what `time -v` reports): the real
    peak, not a sample; the RSS now where the kernel does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _rss()


def process_floor(model: nn.Module, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes this process holds apart from the engine's: its RSS now, after the runtime has warmed up as in the
    probe's runtime figure (planner and engine imported, one tiny training step), less the model's own tensors in
    RAM (wrapping replaces them by the tiers', which the plan counts). It includes what the probe's fresh process
    lacks: the data set (held as loaded: a byte a token for text), the tokenizer, the loop's state; and on a CUDA
    `device` what the GPU's runtime holds in host memory once a step has run (`_warm_cuda`).
    [Note: process RSS] in tightfit/planner/costs.py."""
    import tightfit
    import tightfit.planner  # noqa: F401 - what the probe's figure includes
    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.offload import engine_of
    from tightfit.optim import AdamW
    from tightfit.planner.model_profile import profile_model

    with torch.device("meta"):
        profile_model(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)), 2, 16)  # the trace's imports
    tiny = tightfit.wrap(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)),
                         tightfit.Placement.everywhere("host"), device="cpu")
    x = torch.zeros(2, 16, dtype=torch.long)
    tiny(x, x).backward()
    AdamW(tiny.parameters()).step()
    engine_of(tiny).close()
    del tiny
    if device is not None and device.type == "cuda":
        _warm_cuda(device, dtype)
    own = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
              if t.device.type == "cpu")
    return max(0, _rss() - own)


def _warm_cuda(device: torch.device, dtype: torch.dtype) -> None:
    """Run a tiny step on the GPU as the run's will (autocast to `dtype`, fused attention, fused AdamW), so that
    what CUDA keeps in host memory from then on is in the floor: the context, cuBLAS/cuBLASLt's handles and the
    kernels' modules the libraries load on first use. Measured before any CUDA work, the default run's floor was
    500 MiB short on the H200 (predicted RSS 800.6 MiB, measured 1,303.5: benchmarks/RESULTS.md, batch AE)."""
    from tightfit.models.gpt import GPT, GPTConfig

    with torch.random.fork_rng(devices=[device]):  # the run's generators stay untouched
        tiny = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=1, block_size=16, vocab_size=64)).to(device)
        x = torch.zeros(2, 16, dtype=torch.long, device=device)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = tiny(x, x)
        loss.backward()
        torch.optim.AdamW(tiny.parameters(), fused=True).step()
        torch.cuda.synchronize(device)
    del tiny, x, loss


class _Stepping:
    """The step both setups share: (scaled) backward, unscale, clip, step, zero. Subclasses say how to clip.

    `scaler` is torch's GradScaler (plain) or tightfit's LossScaler (offload): the same four calls, fp16 only.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler = None

    def clip_grad_norm(self, max_norm: float) -> float:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the setup holds beyond the model itself (nothing, for plain PyTorch)."""

    def accumulate(self, forwards: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """One step's micro-batches, forward and backward (`forwards[m]()` returns micro-batch m's loss, already
        divided by their number); returns the losses. Micro-batch-major here: each one's forward and backward before
        the next."""
        losses = []
        for m, forward in enumerate(forwards):
            loss = forward()
            self.backward(loss, last=m == len(forwards) - 1)
            losses.append(loss.detach())
        return losses

    def backward(self, loss: torch.Tensor, last: bool = False) -> None:
        """Backward of one micro-batch; `last`: the last before the optimizer step."""
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip_and_step(self, max_norm: float) -> float | None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = self.clip_grad_norm(max_norm) if max_norm > 0 else None
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def export_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors, with the same keys whichever setup wrote them."""
        from tightfit.offload.model_state.state_io import export_state

        return export_state(self.model, self.optimizer)

    def import_state(self, get: Callable[[str], torch.Tensor]) -> None:
        from tightfit.offload.model_state.state_io import import_state

        import_state(self.model, self.optimizer, get)

    plan = None
    """The plan the run was made with (None: `--offload none`, which plans nothing)."""

    def _measured(self, step_seconds: float) -> dict:
        raise NotImplementedError

    def compare_with_plan(self, step_seconds: float) -> str | None:
        return None if self.plan is None else self.plan.compare(self._measured(step_seconds))

    def plan_record(self, step_seconds: float, run_seconds_per_step: float | None = None) -> dict | None:
        """The comparison as data, for metrics.jsonl: each predicted figure beside its measurement (the median step;
        the run's seconds per step, evaluation and saves included, beside it), and what the step's prediction was
        made of (a GPU check reads it: scripts/gpu_check_report.py)."""
        if self.plan is None:
            return None
        pr, hw = self.plan.prediction, self.plan.hardware
        return {"predicted": {key: value for _, key, value, _ in self.plan.figures()},
                "measured": self._measured(step_seconds),
                "step_terms": {"compute_s": pr.compute_s, "host_s": pr.host_s, "copy_s": pr.copy_s,
                               "nvme_s": pr.nvme_s, "optim_s": pr.optim_s, "passes_s": pr.passes_s,
                               "optim_after_s": pr.optim_after_s, "allreduce_s": pr.allreduce_s,
                               "exchange_s": pr.exchange_s,
                               "allreduce_bus_bw": self.plan.shape.allreduce_bw, "bottleneck": pr.bottleneck},
                "hardware": {k: getattr(hw, k) for k in ("device_name", "op_overhead_s", "unit_overhead_s",
                                                         "stream_overhead_s", "step_overhead_s", "duplex_bw",
                                                         "host_pass_bw", "device_workspace", "probe_version",
                                                         "matmul_flops", "attention_flops")},
                "run_seconds_per_step": run_seconds_per_step}


class PlainMemory(_Stepping):
    """Everything on one device, torch's fused AdamW: the reference every other placement is checked against, and
    what `--offload auto` runs where its plan moves nothing (`plan`: [Note: nothing to move, no engine] in
    planner/planner.py)."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, dtype: torch.dtype, plan=None) -> None:
        self.device = device
        self.plan = plan
        self.model = _materialised(model, device)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr,
                                           betas=(o.beta1, o.beta2), fused=True)
        # fp16 needs loss scaling; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self._peak_rss = _rss()

    def describe(self) -> str:
        if self.plan is not None:
            return self.plan.summary()
        return f"memory: plain PyTorch, every state on {self.device} (--offload none)"

    def clip_grad_norm(self, max_norm: float) -> float:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def memory_in_use(self) -> dict[str, int]:
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss, _rss_high_water())
        if self.device.type == "cuda":
            return {"device": torch.cuda.memory_allocated(self.device), "host": rss}
        return {"host": rss}

    def peak_memory(self) -> dict[str, int]:
        self.memory_in_use()
        if self.device.type == "cuda":
            return {"device": torch.cuda.max_memory_allocated(self.device), "host": self._peak_rss}
        return {"host": self._peak_rss}

    def _measured(self, step_seconds: float) -> dict:
        p = self.peak_memory()
        measured = {"rss_peak": p["host"], "step_s": step_seconds}
        if "device" in p:
            measured["device_peak"] = p["device"]
        return measured

    def engine_counters(self) -> dict[str, float] | None:
        return None  # no engine: nothing moves between tiers


class OffloadMemory(_Stepping):
    """The offload engine holding the states where the plan put them (tightfit.wrap + tightfit.optim.AdamW)."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, dtype: torch.dtype, plan) -> None:
        import tightfit
        from tightfit.offload import LossScaler, engine_of
        from tightfit.planner.from_python import tile_as_planned

        self.plan = plan
        self.device = device
        placement, units = tile_as_planned(model, plan)  # the plan's tiles, and its units (the one place: from_python)
        # Names and shapes as the model declares them; once wrapped, released parameters are empty views.
        self._shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        self.model = tightfit.wrap(model, placement, compute_dtype=dtype, device=device, units=units)
        self.engine = engine_of(self.model)
        o = cfg.optim
        self.optimizer = tightfit.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr,
                                              betas=(o.beta1, o.beta2))
        self.scaler = LossScaler() if dtype == torch.float16 else None
        self._step_early = o.grad_clip <= 0 and self.scaler is None
        # Unit-major order where the plan chose it (offload/step/unit_major.py): each unit runs every micro-batch
        # before the next; its hooks stay until the engine closes.
        self._unit_major = None
        if plan.shape.unit_major:
            from tightfit.offload.step.unit_major import UnitMajor

            self._unit_major = UnitMajor(self.model, boundaries_on_host=plan.shape.boundaries_on_host)
        self._peak_rss = _rss()
        self._closed_report: dict | None = None  # the engine's meters as they stood when it was closed

    def describe(self) -> str:
        return self.plan.summary()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.optimizer.clip_grad_norm_(max_norm)

    def close(self) -> None:
        """Close the engine (drains write-backs, stops the I/O threads, deletes the swap files). Its meters are kept
        as they stood: the run's last save closes it ([Note: the last save takes the swap's place] in
        memory_model.py) before the summary reports the peaks, and a closed store holds no bytes."""
        if self._closed_report is None:
            self._closed_report = self.engine.memory_report()
        self.engine.close()

    def _report(self) -> dict:
        return self._closed_report if self._closed_report is not None else self.engine.memory_report()

    def accumulate(self, forwards: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        if self._unit_major is None:
            return super().accumulate(forwards)
        losses = self._unit_major.run(forwards, backward=self.scaler.scale if self.scaler else (lambda loss: loss),
                                      before_backward=self._declare)
        return [loss.detach() for loss in losses]

    def backward(self, loss: torch.Tensor, last: bool = False) -> None:
        if last:
            self._declare()
        super().backward(loss, last)

    def _declare(self) -> None:
        """Before the step's last backward. Without clipping or loss scaling nothing needs every gradient before a
        unit steps: each unit's optimizer step then runs during it, as its gradients land (docs/ENGINE.md, "Clipping
        and overlap"). With clipping the step waits for backward, but each unit's optimizer state still loads
        during it."""
        if self._step_early:
            self.optimizer.step_during_backward()
        else:
            self.optimizer.preload_during_backward()

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._shapes)

    def engine_counters(self) -> dict[str, float] | None:
        """The engine's counters since it was built (`OffloadEngine.counters`); the loop takes differences."""
        return self.engine.counters()

    def memory_in_use(self) -> dict[str, int]:
        r = self._report()
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss, _rss_high_water())
        return {"device": r["device"]["in_use"], "host": r["host"]["tier"] + r["host"]["staging"] + r["host"]["boundaries"],
                "nvme": r["nvme"]["bytes"], "rss": rss}

    def peak_memory(self) -> dict[str, int]:
        r = self._report()
        self.memory_in_use()
        peaks = {"device": r["device"]["peak"], "host": r["host"]["tier"] + r["host"]["staging_peak"] + r["host"]["boundaries"],
                 "nvme": r["nvme"]["bytes"], "rss": self._peak_rss}
        if self.device.type == "cuda":
            peaks["cuda_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return peaks

    def _measured(self, step_seconds: float) -> dict:
        p = self.peak_memory()
        measured = {"device_engine_peak": p["device"], "host_peak": p["host"], "nvme_peak": p["nvme"],
                    "rss_peak": p["rss"], "step_s": step_seconds}
        if "cuda_allocated" in p:
            measured["device_peak"] = p["cuda_allocated"]
        return measured


def cap_device_memory(device: torch.device, gpu_mem: int) -> float | None:
    """Cap the CUDA caching allocator's reserved bytes at --gpu-mem; returns the fraction set (None off CUDA).

    Why: a budget the run can overshoot is no budget. Under the cap the allocator frees its cached segments and
    retries before it fails, so the plan's allocated bytes plus its allocator share ([Note: reserved vs allocated],
    planner/budgets.py) are what the GPU gives this process."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index  # torch wants an index here
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, gpu_mem / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def setup_memory(model: nn.Module, cfg: Config, device: torch.device, dtype: torch.dtype,
                 planned: Callable | None = None, autocast: bool = True, averaging=None,
                 say: Callable[[str], None] | None = None, plain_if_still: bool = True) -> MemorySetup:
    """Pick how the run holds its model: plain PyTorch (--offload none), or the offload engine with the plan.
    `planned(plan)` runs once the plan is made, before the engine allocates anything (a check that can refuse the
    run while that is cheap). `autocast`: whether the loop's forward runs under `torch.autocast` (`tightfit
    train`'s does; `make_plan`). `averaging`: one rank of replicas averaging gradients (`make_plan`).
    `plain_if_still`: under --offload auto, plain PyTorch where the plan moves nothing ([Note: nothing to move, no
    engine] in planner/planner.py); False keeps the engine (a benchmark of the engine's side)."""
    if cfg.memory.gpu_mem is not None:
        from tightfit.utils.sizes import parse_size

        cap_device_memory(device, parse_size(cfg.memory.gpu_mem, "--gpu-mem"))
    if cfg.memory.offload == "none":
        return PlainMemory(model, cfg, device, dtype)
    from tightfit.config import parse_nvme
    from tightfit.planner import make_plan
    from tightfit.planner.probe import load_or_probe

    # What takes long before the first step (the probe on a new machine, tracing and placing a large model, pinning
    # its host tiers) is said as it starts: a 7B run's set-up is minutes, and silence would look like a hang.
    say = say or (lambda line: None)
    t0 = time.perf_counter()
    # The plan's floor is this process's, measured now (the probe's is a fresh process without the data set).
    hw = load_or_probe(parse_nvme(cfg.memory.nvme)[0] if cfg.memory.nvme else None,
                       lambda: say("setup: measuring this machine once (about 30 s; cached for the runs after)"))
    hw = replace(hw, runtime_rss=max(hw.runtime_rss, process_floor(model, device, dtype)))
    t1 = time.perf_counter()
    say(f"setup: planning {sum(p.numel() for p in model.parameters()):,} parameters")
    plan = make_plan(model, cfg, hw, autocast=autocast, averaging=averaging, plain_if_still=plain_if_still)
    if planned is not None:
        planned(plan)
    t2 = time.perf_counter()
    if not plan.shape.engine:  # [Note: nothing to move, no engine] in planner/planner.py
        return PlainMemory(model, cfg, device, dtype, plan)
    say(f"setup: planned in {t2 - t1:.0f} s (the machine's profile {t1 - t0:.0f} s); building the tiers")
    return OffloadMemory(model, cfg, device, dtype, plan)


__all__ = ["MemorySetup", "OffloadMemory", "PlainMemory", "cap_device_memory", "param_groups", "setup_memory"]
