"""What a model costs, measured without allocating it: parameter bytes, activations and work per unit.

Why a meta-device trace: the planner must answer "does it fit?" before a single real byte is allocated (the model
may be 100x the machine). A forward + backward of one micro-batch at the configured shape runs on meta tensors
(shapes and dtypes only, no data, no compute) under a dispatch mode that sees every aten op. From that one pass we
get, exactly for this model and this micro-batch x seq_len:
- the bytes autograd saves for backward, per unit (through saved-tensor hooks, deduplicated by storage);
- the peak of live activation bytes over the step (tracking every op output until its last reference dies;
  parameter gradients are not activations: the engine counts them as gradients in flight), and how the root
  unit's gradients overlap it (a language model's head gradient arrives at backward's start, with the activations
  at their peak; its embedding gradient at backward's end, when most are freed);
- the work per unit (`work.py`): matmul and attention FLOPs by the keys their rates are measured under, the bytes
  of the elementwise ops the probe times one by one, memory traffic of everything else, and the op count (per-op
  dispatch overhead matters for small models on CPU).
Hardware enters only later (`costs.py`), so one profile serves every what-if.

Units follow the engine's rule (`tightfit/offload/step/units.py` when present): the children of every nn.ModuleList
whose children all share one class are units; everything else belongs to `ROOT_UNIT`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tightfit.offload.placement import ROOT_UNIT
from tightfit.offload.step.units import find_units, root_modules
from tightfit.planner.autocast_trace import MetaAutocast
from tightfit.planner.chain import ChainCheck
from tightfit.planner.work import Work, count_op, matmul_key
from tightfit.tiling.linear import linear_features

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
"""A compute dtype's name as `profile_model` and `--precision` take it."""


@dataclass
class UnitProfile:
    """One unit: what it stores and what it costs per micro-step."""

    name: str
    """Module path of the unit ("blocks.3") or ROOT_UNIT."""
    numel: int
    """Parameters in the unit."""
    trainable: int
    """Parameters with requires_grad (only these get gradients, master weights and Adam moments)."""
    largest_linear: tuple[str, int, int] | None
    """(module path, in_features, out_features) of the unit's largest Linear (or Conv1D), for the tiling decision."""
    act_saved: int
    """Bytes autograd keeps from this unit's forward until its backward (no checkpointing)."""
    act_input: int
    """Bytes of the unit's input: all a checkpointed unit keeps (its forward is recomputed in backward)."""
    fwd: Work = field(default_factory=Work)
    """Forward work of one micro-batch."""
    bwd: Work = field(default_factory=Work)
    """Backward work of one micro-batch (attributed to units in proportion to their forward FLOPs)."""
    checkpointable: bool = True
    """The unit is one module call (a block); the root unit's leftovers are not."""
    linears: list[tuple[str, int, int]] = field(default_factory=list)
    """Every nn.Linear and Hugging Face Conv1D of the unit, largest first: the candidates for tiling."""
    act_recompute: int = 0
    """Bytes one recomputation of the checkpointed unit holds, when less than `act_saved`: a group of blocks
    recomputes block by block ([Note: grouped blocks] in units.py). 0: `act_saved`."""
    stepped: bool = True
    """This rank steps the unit (holds its master and moments); False: another rank does ([Note: optimizer states
    sharded by unit] in tightfit/parallel/sharded_optimizer.py)."""
    keeps_grads: bool = True
    """Its gradients are summed on this rank; False (ZeRO-2, another rank's unit): reduced to that rank, none kept."""
    holds_params: bool = True
    """Its compute params are kept on this rank; False (ZeRO-3, another rank's unit): that rank sends them for each
    use ([Note: parameters sent for each use] in tightfit/parallel/params_exchange.py)."""
    exchanged: bool = False
    """ZeRO-3, a unit one rank owns: every use of its params on this rank comes through the exchange."""

    @property
    def stepped_numel(self) -> int:
        """Parameters this rank's optimizer steps: the trainable ones, where it steps the unit."""
        return self.trainable if self.stepped else 0

    @classmethod
    def from_dict(cls, d: dict) -> "UnitProfile":
        d = dict(d)
        d["fwd"], d["bwd"] = Work.from_dict(d["fwd"]), Work.from_dict(d["bwd"])
        d["largest_linear"] = tuple(d["largest_linear"]) if d["largest_linear"] else None
        d["linears"] = [tuple(x) for x in d.get("linears", [])]
        return cls(**d)


@dataclass
class ModelProfile:
    """Every unit in execution order, plus whole-step activation facts."""

    units: list[UnitProfile]
    """Units in forward execution order (root first: its embeddings run first)."""
    compute_dtype: str
    """"fp32", "bf16" or "fp16": dtype of compute parameters and activations."""
    micro_batch: int
    """Sequences per micro-batch the profile was traced at."""
    seq_len: int
    """Tokens per sequence the profile was traced at."""
    act_peak: int
    """Peak live activation bytes over forward + backward without checkpointing (saved + transient); parameter
    gradients are not counted (the memory model counts them as gradients in flight)."""
    measured: bool = True
    """False when the trace failed and activations/work come from a formula (see `reasons`)."""
    note: str = ""
    """Why the trace fell back, when it did."""
    root_grads_early: int | None = None
    """Bytes of the root unit's gradients (compute dtype) that backward produces before the last of them (a
    language model's head and final norm; its embedding's comes last): those in flight while the activations peak,
    at backward's start or in a checkpointed block's recomputation. None when unknown (a formula profile, a plan
    file written before it was traced): all of the root's gradients."""
    act_at_root_end: int | None = None
    """Activation bytes live from the root's last gradient (a language model's embedding) to backward's end, when
    all the root's gradients are in flight. None when unknown: `act_peak`."""
    largest_param: int = 0
    """Elements of the model's largest parameter: what a checkpoint's save may read at once beyond its pieces
    ([Note: the save] in memory_model.py). 0 when unknown (a plan file written before it was kept)."""
    autocast: bool = False
    """Traced with autocast's casts (autocast_trace.py): the loop runs its forward under `torch.autocast`."""
    chain: str | None = None
    """"" when the units form a chain (unit-major accumulation can run them: planner/chain.py), else why not; None
    when unknown (a formula profile, a plan file written before it was traced)."""
    tail_saved: int = 0
    """Of the root's `act_saved`, the bytes its tail saves (the code after the last unit, from the first module of
    the root with parameters of its own: a final norm, the head, the loss), which in unit-major order wait for no
    other micro-batch ([Note: the tail per micro-batch] in offload/step/unit_major.py). 0: no tail is cut (or not
    known)."""
    tail_input: int = 0
    """Bytes of the tensor entering the tail (the last unit's output) for one micro-batch; 0 as `tail_saved`."""

    @property
    def act_transient(self) -> int:
        """Peak bytes beyond what is saved: gradients of activations, logits, temporaries of the running op."""
        return max(0, self.act_peak - sum(u.act_saved for u in self.units))

    def unit(self, name: str) -> UnitProfile:
        return next(u for u in self.units if u.name == name)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def grouped(self, groups: dict[str, list[str]]) -> "ModelProfile":
        """This profile with the blocks of each group joined into one unit (`find_units(min_bytes=...)`)."""
        by_name = {u.name: u for u in self.units}
        first_of = {members[0]: name for name, members in groups.items()}
        joined = {m for members in groups.values() for m in members}
        units = []
        for u in self.units:
            if u.name not in first_of:
                if u.name not in joined:
                    units.append(u)
                continue
            name = first_of[u.name]
            parts = [by_name[m] for m in groups[name]]
            fwd, bwd = Work(), Work()
            for part in parts:
                fwd.add(part.fwd)
                bwd.add(part.bwd)
            linears = sorted((lin for part in parts for lin in part.linears), key=lambda lin: -lin[1] * lin[2])
            units.append(UnitProfile(
                name, sum(q.numel for q in parts), sum(q.trainable for q in parts),
                max((q.largest_linear for q in parts if q.largest_linear), key=lambda lin: lin[1] * lin[2],
                    default=None),
                sum(q.act_saved for q in parts), sum(q.act_input for q in parts), fwd, bwd,
                all(q.checkpointable for q in parts), linears,
                max(q.act_recompute or q.act_saved for q in parts), all(q.stepped for q in parts),
                all(q.keeps_grads for q in parts), all(q.holds_params for q in parts),
                any(q.exchanged for q in parts)))
        return replace(self, units=units)

    def with_micro_batch(self, micro_batch: int) -> "ModelProfile":
        """This profile at another micro-batch: activations and work scale with the sequences, the op count and
        the parameters do not (what the planner checks a suggested --micro-batch with, without tracing again)."""
        f = micro_batch / self.micro_batch

        units = [replace(u, act_saved=int(u.act_saved * f), act_input=int(u.act_input * f),
                         act_recompute=int(u.act_recompute * f), fwd=u.fwd.scaled_data(f), bwd=u.bwd.scaled_data(f))
                 for u in self.units]
        end = None if self.act_at_root_end is None else int(self.act_at_root_end * f)
        return replace(self, units=units, micro_batch=micro_batch, act_peak=int(self.act_peak * f),
                       act_at_root_end=end, tail_saved=int(self.tail_saved * f), tail_input=int(self.tail_input * f))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        d = dict(d)
        d["units"] = [UnitProfile.from_dict(u) for u in d["units"]]
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------------
# Units


def unit_layout(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, int], dict[str, int]]:
    """(unit name -> module for non-root units, unit -> numel, unit -> trainable numel), in execution order.

    The engine's own detector (`tightfit.offload.units.find_units`), so the planner's units are the engine's units,
    padding of its flat buffers included.
    """
    specs = find_units(model)
    mods = {s.name: s.module for s in specs if s.name != ROOT_UNIT}
    return mods, {s.name: s.numel for s in specs}, {s.name: s.train_numel for s in specs}


def _unit_of_param(name: str, unit_names: list[str]) -> str:
    for u in unit_names:
        if name.startswith(u + "."):
            return u
    return ROOT_UNIT


# ---------------------------------------------------------------------------------------------------------------
# The meta trace


class _FusedAttention(TorchFunctionMode):
    """Route `F.scaled_dot_product_attention` to the fused kernel the real device would pick.

    On meta tensors SDPA falls back to the math path, which materialises the [T, T] scores; CPU and CUDA both run a
    flash kernel that saves only the output and a log-sum-exp. Without this the profile would over-state attention
    activations by a factor of T / head_dim.
    """

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if kwargs.get("enable_gqa") and q.dim() == k.dim() >= 3 and k.shape[-3] and \
                    q.shape[-3] % k.shape[-3] == 0:
                # Grouped-query attention: the kernels take the key/value heads repeated to the query's.
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
                v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
            # With dropout the CPU has no fused kernel (the math path saves the [T, T] probabilities and the
            # mask); CUDA's flash kernel draws its dropout from a seed it saves.
            fused = not dropout or self.cuda
            if fused and mask is None and q.shape[-1] == v.shape[-1] and q.shape[:-2] == k.shape[:-2]:
                scale = kwargs.get("scale")
                if self.cuda and q.dtype in (torch.float16, torch.bfloat16):
                    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
                else:
                    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                                      scale=scale)
                return out[0]
        return func(*args, **kwargs)


_VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "reshape", "detach", "alias",
             "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "as_strided", "_reshape_alias",
             "lift_fresh", "unbind"}
def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Tracer(TorchDispatchMode):
    """Counts work per phase/unit and logs the life of every activation storage over one meta step.

    Liveness: every op output's storage is counted from creation until the last Python tensor object viewing it is
    collected (weakref finalizers). Autograd's saved tensors stay referenced because the saved-tensor hook returns
    them as Python objects, so they count while saved, as on a real device. Which storages were parameter
    gradients is known only once autograd accumulates them, so the peaks are computed afterwards, by replaying the
    log (`peaks`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.unit = ROOT_UNIT
        self.phase = "fwd"
        self.work: dict[tuple[str, str], Work] = {}
        self.live: dict[int, list[int]] = {}  # storage key -> [nbytes, live tensor objects, allocation id]
        self.log: list[tuple[int, int]] = []  # (allocation id, +bytes or -bytes); _ROOT_GRAD: a root gradient arrived
        self.grad_ids: set[int] = set()  # allocations that became parameter gradients
        self.ignore: set[int] = set()  # storages of parameters (not activations)

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.ignore:
            return
        entry = self.live.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            entry = self.live[key] = [nbytes, 0, len(self.log)]
            self.log.append((entry[2], nbytes))
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.log.append((entry[2], -entry[0]))
            del self.live[key]

    def grad_arrived(self, grad: torch.Tensor, root_bytes: int) -> None:
        """Autograd accumulated `grad` into a parameter; `root_bytes`: what the root unit's gradients in flight
        grew by (its parameter's first gradient of the step; 0 for a block's, or a tied parameter's second)."""
        entry = self.live.get(_storage_key(grad))
        if entry is not None:
            self.grad_ids.add(entry[2])
        if root_bytes:
            self.log.append((_ROOT_GRAD, root_bytes))

    def peaks(self) -> tuple[int, int, int]:
        """(activations' peak, bytes of the root's gradients that arrived before its last one, activations from
        the last one on): the three figures `ModelProfile` keeps ([Note: phases] in memory_model.py)."""
        arrivals = [i for i, (ident, _) in enumerate(self.log) if ident == _ROOT_GRAD]
        last = arrivals[-1] if arrivals else len(self.log)
        act = peak = after = 0
        for i, (ident, n) in enumerate(self.log):
            if ident != _ROOT_GRAD and ident not in self.grad_ids:
                act += n
            peak = max(peak, act)
            if i >= last:
                after = max(after, act)
        early = sum(self.log[i][1] for i in arrivals[:-1])
        return peak, early, (after if arrivals else peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _VIEW_OPS:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                if isinstance(o, torch.Tensor):
                    self._track(o)
            return out
        w = self.work.setdefault((self.unit, self.phase), Work())
        w.n_ops += 1
        tensors_in = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        count_op(w, func, args, kwargs, out, tensors_in, outs)
        for o in outs:
            self._track(o)
        return out


_ROOT_GRAD = -1


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _loss_fn(model: nn.Module, vocab: int):
    """How to run one training micro-step of `model`: (ids, targets) -> scalar loss."""
    from tightfit.models.gpt import GPT

    if isinstance(model, GPT):
        return lambda call, ids: call((ids, ids))
    if hasattr(getattr(model, "config", None), "vocab_size"):  # Hugging Face causal LM
        return lambda call, ids: call((), {"input_ids": ids, "labels": ids}).loss
    return lambda call, ids: call((ids,)).float().mean()


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", 256))


def profile_model(model: nn.Module, micro_batch: int, seq_len: int, compute_dtype: str = "fp32",
                  cuda: bool = False, autocast: bool | None = None) -> ModelProfile:
    """Profile `model` (on any device, including meta) for one micro-batch of [micro_batch, seq_len] tokens.

    `autocast`: whether the run's forward runs under `torch.autocast` to the compute dtype, as `tightfit train`'s
    and the Hugging Face Trainer's bf16 and fp16 steps do (the default where the compute dtype is not fp32): the
    trace then makes autocast's casts (autocast_trace.py)."""
    unit_mods, numel, trainable = unit_layout(model)
    names = list(unit_mods)
    linears: dict[str, list[tuple[str, int, int]]] = {}
    for mpath, mod in model.named_modules():
        feats = linear_features(mod)  # an nn.Linear, or a Hugging Face Conv1D (GPT-2's layers): both can be tiled
        if feats is not None:
            u = _unit_of_param(mpath + ".weight", names)
            linears.setdefault(u, []).append((mpath, *feats))
    for lst in linears.values():
        lst.sort(key=lambda x: -x[1] * x[2])

    order = [ROOT_UNIT, *names]
    units = {n: UnitProfile(n, numel[n], trainable[n], (linears.get(n) or [None])[0], 0, 0,
                            checkpointable=n != ROOT_UNIT, linears=linears.get(n, [])) for n in order}
    autocast = compute_dtype != "fp32" and autocast is not False  # an fp32 step has no casts to make
    chain, tail = ChainCheck(), _Tail()
    try:
        act_peak, root_grads, act_end = _trace(model, unit_mods, units, micro_batch, seq_len, _DTYPES[compute_dtype],
                                               cuda, _DTYPES[compute_dtype] if autocast else None, chain, tail)
        measured, note, chain_says = True, "", chain.problem
    except Exception as e:  # a model the generic step cannot drive: fall back to a formula, and say so
        act_peak, root_grads, act_end = _formula(units, micro_batch, seq_len, DTYPE_BYTES[compute_dtype]), None, None
        measured, note = False, f"meta trace failed ({type(e).__name__}: {e}); activations and work estimated"
        chain_says, tail = None, _Tail()
    return ModelProfile(list(units.values()), compute_dtype, micro_batch, seq_len, act_peak, measured, note,
                        root_grads, act_end, max((p.numel() for p in model.parameters()), default=0), autocast,
                        chain_says, tail.saved if chain_says == "" else 0, tail.input if chain_says == "" else 0)


class _Tail:
    """What the trace saw of the model's tail ([Note: the tail per micro-batch] in offload/step/unit_major.py): the
    bytes saved in forward from its first module on, and the bytes entering it."""

    def __init__(self) -> None:
        self.saved, self.input = 0, 0


def _input_bytes(args) -> int:
    """Bytes of a module call's first tensor argument (0 without one)."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return x.numel() * x.element_size() if x is not None else 0


def _trace(model, unit_mods, units, micro_batch, seq_len, dtype, cuda,
           autocast: torch.dtype | None = None, chain: ChainCheck | None = None,
           tail: _Tail | None = None) -> tuple[int, int, int]:
    """Trace one micro-step, its forward under autocast to `autocast` where given (autocast_trace.py); returns
    `_Tracer.peaks()` and fills each unit's saved bytes and work. `chain`: records what enters each unit and, after
    forward, whether the units form a chain (its `problem`: "" if they do). `tail`: filled with the tail's bytes."""
    tail = tail if tail is not None else _Tail()
    tracer = _Tracer()
    params = {n: torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta")
              .requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: torch.empty(b.shape, dtype=b.dtype, device="meta") for n, b in model.named_buffers()}
    tracer.ignore = {_storage_key(t) for t in [*params.values(), *buffers.values()]}
    root_seen: set[str] = set()
    for name, p in params.items():
        if not p.requires_grad:
            continue

        def arrived(t, name=name, root=_unit_of_param(name, list(unit_mods)) == ROOT_UNIT):
            # The engine keeps a root gradient until the root's last one arrived, a block's until its backward is
            # done (the memory model's gradients in flight); the trace drops it here.
            first = root and name not in root_seen
            root_seen.add(name)
            tracer.grad_arrived(t.grad, t.numel() * t.element_size() if first else 0)
            t.grad = None

        p.register_post_accumulate_grad_hook(arrived)

    saved: dict[str, dict[int, int]] = {n: {} for n in units}

    tail_keys: set = set()

    def pack(t):
        key = _storage_key(t)
        if key not in tracer.ignore and tracer.phase == "fwd":
            saved[tracer.unit].setdefault(key, t.untyped_storage().nbytes())
            if chain is not None and chain.tail and tracer.unit == ROOT_UNIT:  # saved by the tail
                tail_keys.add(key)
        return t

    handles = []
    for name, mod in unit_mods.items():
        def pre(m, args, kwargs, name=name):
            tracer.unit = name
            units[name].act_input = _input_bytes(args)
            if chain is not None:
                chain.enter(name, args, kwargs)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(lambda m, a, o: setattr(tracer, "unit", ROOT_UNIT)))
    for path, mod in root_modules(model, list(unit_mods)):
        def tail_pre(m, args, kwargs, path=path):
            if chain is not None and chain.enter_tail(path, args, kwargs):
                tail.input = _input_bytes(args)

        handles.append(mod.register_forward_pre_hook(tail_pre, with_kwargs=True))
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    run = _loss_fn(model, _vocab(model))
    try:
        with _FusedAttention(cuda), _hf_meta_compat(), tracer, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with MetaAutocast(autocast, "cuda" if cuda else "cpu") if autocast else contextlib.nullcontext():
                loss = run(lambda a, k=None: functional_call(model, {**params, **buffers}, a, k), ids)
            if chain is not None:
                chain.problem = chain.verdict(loss)
            tracer.unit, tracer.phase = ROOT_UNIT, "bwd"
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    tail.saved = sum(saved[ROOT_UNIT][k] for k in tail_keys)
    for name, u in units.items():
        u.act_saved = sum(saved[name].values())
        u.fwd = tracer.work.get((name, "fwd"), Work())
    # Backward ops run outside any module hook; give each unit a share proportional to its forward FLOPs.
    bwd = tracer.work.get((ROOT_UNIT, "bwd"), Work())
    total_fwd = sum(u.fwd.flops for u in units.values()) or 1.0
    for u in units.values():
        u.bwd = bwd.scaled(u.fwd.flops / total_fwd)
    return tracer.peaks()


@contextlib.contextmanager
def _hf_meta_compat():
    """Let Hugging Face's masking code run on meta tensors, as it runs on the real batch.

    Without a cache and an attention mask (fine-tuning: `use_cache=False`, what gradient checkpointing sets),
    transformers' `masking_utils.find_packed_sequence_indices` decides from the position ids whether several
    sequences are packed in a row, with a data-dependent `.all()`: `.item()` on meta, which fails, and the planner fell
    back to a formula for every Llama, Mistral, Qwen2, Gemma, Phi and GPT-2 fine-tune (issue 26). The trace's position
    ids are 0..T-1 in every row, for which the function answers None (not packed): it does here, on meta."""
    try:
        import transformers.masking_utils as mu
    except ImportError:  # transformers not installed, or a version without it: nothing to do
        yield
        return
    real = getattr(mu, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda position_ids: None if position_ids.is_meta else real(position_ids)
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = real


def _formula(units: dict[str, UnitProfile], micro_batch: int, seq_len: int, nbytes: int) -> int:
    """Activation estimate when tracing fails: ~16 hidden-sized tensors saved per block (attention excluded)."""
    tokens = micro_batch * seq_len
    total = 0
    for u in units.values():
        hidden = u.largest_linear[1] if u.largest_linear else 0
        u.act_input = tokens * hidden * nbytes
        u.act_saved = 16 * u.act_input if u.checkpointable else 2 * u.act_input
        u.fwd = Work({matmul_key(tokens, hidden, hidden, nbytes): 2.0 * tokens * u.numel}, 8.0 * u.act_input, 30)
        u.bwd = u.fwd.scaled(2.0)
        total += u.act_saved
    return int(total * 1.25)
