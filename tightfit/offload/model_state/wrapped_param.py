"""`OffloadedParameter`: what a wrapped model's parameters become, so that touching one outside the engine's
forward/backward gives its value or one clear error, never a read of freed memory.

Why a Parameter subclass: between uses a unit's parameters are views of a flat buffer whose storage is freed
([Note: flat buffer and storage resizing], step/unit.py): reading one (`p.sum()`, `print(p)`, `p.data`) would read
freed memory (a segfault). Code outside tightfit reaches the parameters in ways no hook of torch's sees: any torch
function, `p.data`, `p.grad`, `model.half()` (`_apply` calls `p.half()`), a `torch.optim.Optimizer`'s constructor
(`add_param_group` reads `p.is_leaf`), `torch.nn.utils.clip_grad_norm_` (reads `p.grad`). Every one of those goes
through `__torch_function__`, so the class is the one hook point. The object stays the same `nn.Parameter` (same
identity, hooks, registries; `isinstance(p, nn.Parameter)` holds); only its `__class__` changes, and `uninstall`
gives the original back. Nothing is stored on the parameter: what it belongs to is in `_SLOTS`, keyed by identity.

[Note: what a wrapped parameter answers] Inside the engine's forward/backward every call passes straight through
(the cost: one Python call per torch function that takes a parameter), and so does every call outside them on a
parameter whose storage lasts: its unit resident on the device tier, or staged for a load (module_state.py).
Outside forward/backward, for any other parameter (released, or materialised only until its next release):
- metadata (shape, dtype, device, requires_grad, numel, `empty_like`, ...): answered as is;
- reads (`p.sum()`, `p.detach()`, `p.data`, `print(p)`, `p.tolist()`): computed on a copy of the parameter's
  compute values (from the materialised buffer, or read from its tier after the optimizer's write-backs), on the
  parameter's device; no alias of storage that a release frees is handed out. With autograd recording and
  `p.requires_grad`, a read is refused: the result could not carry a gradient back to the tier, and a silently
  missing gradient (an L2 penalty outside forward) is worse than an error. `torch.no_grad()`, `p.detach()` and
  `p.data` read;
- writes (`p.copy_(x)`, `p.zero_()`, `p[...] = x`, `out=p`) and conversions that would change the dtype or device
  (`.half()`, `.to("cuda")`, `.double()`): refused, naming what to call instead (`load_state_dict`, `wrap(...,
  compute_dtype=..., device=...)`). A conversion to what the parameter already is returns it unchanged, so
  `model.float()` on fp32 compute and `model.to(its device)` work;
- `p.grad`: stays None; the gradient is in the engine's grads tier. While the engine holds one for `p`, torch's
  clippers (`clip_grad_norm_`, `clip_grad_value_`, found by their frame) are refused, naming `opt.clip_grad_norm_`:
  they would clip nothing and report 0. `model.zero_grad()` and `p.grad = None` drop the engine's gradient of `p`,
  as they drop `param.grad` of a plain model;
- a `torch.optim.Optimizer` other than `tightfit.optim.AdamW` is refused when it is built over a wrapped parameter
  (and, built before `wrap`, at its first step: `_refuse_foreign_step`).
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

from tightfit.errors import UsageError
from tightfit.offload.step.lifecycle import Event, ParamsState
from tightfit.offload.step.unit import PARAMS, OffloadUnit
from tightfit.offload.step.units import Slot


@dataclass(frozen=True)
class ParamInfo:
    """What one wrapped parameter belongs to. `state` is the model's ModuleState (module_state.py)."""

    state: object
    unit: OffloadUnit
    slot: Slot
    index: int | None
    """Index into `unit.trainable`; None for a frozen parameter."""
    original_class: type


_SLOTS: dict[int, ParamInfo] = {}
"""id(parameter) -> its ParamInfo, from `install` to `uninstall` (the engine's close). Keyed by id, not weakly:
the engine's unit specs hold the parameters until close, so an id cannot be reused while its entry exists."""

_local = threading.local()
"""`bypass`: depth of tightfit's own code touching parameters as plain tensors (state_dict gathering, staging)."""


class bypass:
    """Within this block, wrapped parameters are plain tensors to the current thread (tightfit's own use)."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1
        self._off = DisableTorchFunctionSubclass()
        self._off.__enter__()

    def __exit__(self, *exc):
        self._off.__exit__(*exc)
        _local.depth -= 1


def info_of(p) -> ParamInfo | None:
    info = _SLOTS.get(id(p))
    return info if info is not None and info.slot.param is p else None


_disabled = torch._C._disabled_torch_function_impl  # runs `func` with subclass dispatch off (nn.Parameter's own)


def _plain(func, args, kwargs):
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


# Functions that read no parameter values (metadata, hooks, new tensors shaped like it): they pass through.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "is_signed", "get_device", "data_ptr", "untyped_storage", "_typed_storage",
    "storage", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "is_pinned",
    "is_shared", "is_inference", "_is_view", "new_empty", "new_zeros", "new_ones", "new_full", "empty_like",
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "__hash__", "__len__",
    "__reduce_ex__", "__setstate__", "__deepcopy__", "_has_compatible_shallow_copy_type", "dim_order",
}
_CONVERSIONS = {"to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
_REPRS = {"__repr__", "__str__", "__format__"}
# Reads whose result carries no gradient: served under autograd too.
_DETACHED = _REPRS | {"detach", "tolist", "item", "numpy", "__bool__", "__float__", "__int__", "__index__",
                      "__array__", "equal", "allclose", "__eq__", "__ne__", "eq", "ne", "isnan", "isfinite"}
_GETSET = ("__get__", "__set__", "__delete__")


def _is_write(name: str) -> bool:
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


class OffloadedParameter(nn.Parameter):
    """A parameter of a wrapped model; see [Note: what a wrapped parameter answers]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # The hot path, every op in the model's forward: the first wrapped argument's engine is computing.
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, OffloadedParameter):
                info = _SLOTS.get(id(a))
                if info is not None and info.state.engine.computing:
                    return _disabled(func, types, args, kwargs)
                break
        if getattr(_local, "depth", 0):
            return _plain(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _GETSET:
            return _attribute(func, name, args, kwargs)
        if name in _METADATA:
            return _plain(func, args, kwargs)
        return _call(func, name, args, kwargs)


def _attribute(func, kind, args, kwargs):
    attr = getattr(getattr(func, "__self__", None), "__name__", "")
    p = args[0]
    info = info_of(p)
    if info is None or _engine_busy(info):
        return _plain(func, args, kwargs)
    if attr == "grad":
        # `param.grad` stays None: the gradient is in the engine's grads tier. Two readers of it are told apart by
        # their frame: torch's clippers (refused: they would clip nothing) and nn.Module.zero_grad (drops it).
        real = _plain(func, args, kwargs)
        if kind == "__get__" and real is None and info.index is not None and info.unit.has_grad[info.index]:
            caller = _caller()
            if caller in _codes("clip"):
                raise UsageError(_CLIP)
            if caller in _codes("zero_grad"):
                _drop_grad(info)
        if kind == "__set__" and args[1] is None:
            _drop_grad(info)
        return real
    if attr == "data" and kind == "__get__":
        if not _stable(info):
            return _value(p, info)
        # An alias of the device copy: read after the unit's step, and after its writes into it, as a GPU stream
        # orders them ([Note: device writes in stream order] in runtime/movers.py).
        info.state.engine.wait_step(info.unit)
        info.state.engine.mover.order_compute()
    if attr == "is_leaf" and kind == "__get__":
        _refuse_foreign_optimizer()
    return _plain(func, args, kwargs)


def _engine_busy(info: ParamInfo) -> bool:
    """In the engine's forward or backward (its phase; BACKWARD from the first backward hook to the end of
    backward): the engine decides what is in memory; everything passes through."""
    engine = info.state.engine
    return engine.computing


def _valid(info: ParamInfo) -> bool:
    """Does the parameter's storage hold its values now (materialised, resident, or staged for a load)?"""
    unit = info.unit
    return (unit.params_state in (ParamsState.RESIDENT, ParamsState.READY, ParamsState.KEPT_FOR_STEP)
            or info.state.is_staged(unit))


def _stable(info: ParamInfo) -> bool:
    """Does the parameter's storage hold its values for as long as anyone may keep an alias of it (`p.data`, a view)?
    Resident units and staged ones; a materialised unit's storage is freed at its release, so outside forward and
    backward its parameters are read through copies."""
    unit = info.unit
    return unit.params_state == ParamsState.RESIDENT or info.state.is_staged(unit)


def _writable(info: ParamInfo) -> bool:
    """Does a write to the parameter's storage reach its fp32 master? Staged for a load, or resident on the device
    tier as its own master (fp32 compute): a materialised copy is dropped at release, a compute copy is overwritten
    from the master at the next step."""
    unit = info.unit
    return info.state.is_staged(unit) or (unit.params_state == ParamsState.RESIDENT and unit.master_entry == PARAMS)


def _wrapped_args(args, kwargs) -> list:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, OffloadedParameter):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, OffloadedParameter))
    return found


def _call(func, name, args, kwargs):
    wrapped = [(p, info_of(p)) for p in _wrapped_args(args, kwargs)]
    wrapped = [(p, i) for p, i in wrapped if i is not None and not _engine_busy(i)]
    if not wrapped:
        return _plain(func, args, kwargs)
    if name in _CONVERSIONS:
        return _convert(func, name, args, kwargs, wrapped)
    target = args[0] if args else None
    out = kwargs.get("out")
    for p, info in wrapped:
        written = (_is_write(name) and p is target) or p is out or (isinstance(out, (list, tuple)) and p in out)
        if written and not _writable(info):
            raise UsageError(f"parameter {info.slot.name!r} of a wrapped model cannot be written outside its forward "
                             f"({name}): its values live in the offload engine's tiers; set values with "
                             "model.load_state_dict(...)")
    for _, info in wrapped:
        info.state.settle()
    if name in _REPRS:  # printed as the plain model's parameter would be, from its value
        return _plain(func, (nn.Parameter(_value(args[0], info_of(args[0])), args[0].requires_grad), *args[1:]),
                      kwargs)
    if all(_stable(info) for _, info in wrapped):
        return _plain(func, args, kwargs)
    if name not in _DETACHED and torch.is_grad_enabled():
        for p, info in wrapped:
            if p.requires_grad and not _stable(info):
                raise UsageError(f"parameter {info.slot.name!r} of a wrapped model was used outside the model's "
                                 "forward with autograd recording: its values live in the offload engine's tiers "
                                 "and no gradient could reach them; compute inside the model's forward, or read "
                                 "the value under torch.no_grad() (or with p.detach())")
    values = {id(p): _value(p, info) for p, info in wrapped if not _stable(info)}

    def swap(a):
        if isinstance(a, (list, tuple)):
            return type(a)(swap(x) for x in a)
        return values.get(id(a), a) if isinstance(a, OffloadedParameter) else a

    return _plain(func, tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()})


def _value(p, info: ParamInfo) -> torch.Tensor:
    """A copy of the parameter's compute values on its device (from its tier, or the live buffer)."""
    info.state.settle()
    unit = info.unit
    if _valid(info):
        with bypass():
            return p.detach().clone()
    flat = info.state.read_params(unit)
    return info.slot.view(flat).to(p.device).clone()


def _convert(func, name, args, kwargs, wrapped):
    p, info = wrapped[0]
    if args[0] is not p:
        return _plain(func, args, kwargs)
    if name == "type" and len(args) == 1 and not kwargs:
        return _plain(func, args, kwargs)
    dtype, device = p.dtype, p.device
    if name in ("half", "float", "double", "bfloat16"):
        dtype = {"half": torch.float16, "float": torch.float32, "double": torch.float64,
                 "bfloat16": torch.bfloat16}[name]
    elif name == "cpu":
        device = torch.device("cpu")
    elif name == "cuda":  # `cuda()` means the current CUDA device: the parameter's own if it is on one
        index = args[1] if len(args) > 1 else kwargs.get("device")
        index = torch.device("cuda", index).index if isinstance(index, int) else torch.device(index or "cuda").index
        device = p.device if p.device.type == "cuda" and index in (None, p.device.index) else torch.device("cuda")
    elif name == "to":
        with DisableTorchFunctionSubclass():
            to_device, to_dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        device = torch.device(to_device) if to_device is not None else device
        if device.type == "cuda" and device.index is None and p.device.type == "cuda":
            device = p.device
        dtype = to_dtype or dtype
    else:  # `type(dtype_or_name)`: a dtype conversion
        target = args[1] if len(args) > 1 else kwargs.get("dtype")
        if target is not None and target not in (p.type(), p.dtype):
            dtype = None
    if dtype == p.dtype and device == p.device:
        return p
    engine = info.state.engine
    raise UsageError(f"{name}(): a wrapped model's parameters stay {str(p.dtype).removeprefix('torch.')} on "
                     f"{p.device} (fp32 master weights are kept in the engine's tiers); to compute in another "
                     "dtype or on another device, wrap the unwrapped model with tightfit.wrap(model, placement, "
                     f"compute_dtype=..., device=...) (this one: compute_dtype={engine.compute_dtype}, "
                     f"device={engine.device!s})")


# ---- gradients ---------------------------------------------------------------------------------------------------

_CLIP = ("the gradients of a wrapped model live in the offload engine's grads tier, not in param.grad, so torch's "
         "clip_grad_norm_ would clip nothing and return 0; call opt.clip_grad_norm_(max_norm) on the "
         "tightfit.optim.AdamW, which clips inside its step with the same formula")

_CODES: dict[str, frozenset] = {}


def _codes(kind: str) -> frozenset:
    """The code objects of torch's functions that read `param.grad` for clipping, or to zero it."""
    if not _CODES:
        from torch.nn.utils import clip_grad

        clip = [getattr(clip_grad, n, None) for n in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_",
                                                       "_clip_grads_with_norm_")]
        _CODES["clip"] = frozenset(inspect.unwrap(f).__code__ for f in clip if f is not None)
        _CODES["zero_grad"] = frozenset({nn.Module.zero_grad.__code__})
    return _CODES[kind]


def _caller():
    """The code of the first frame outside this file (and outside a comprehension's own frame)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_name.startswith("<")):
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def _drop_grad(info: ParamInfo) -> None:
    """Forget the engine's accumulated gradient of one parameter (`p.grad = None` outside backward)."""
    unit, i = info.unit, info.index
    if i is None or not unit.has_grad[i] or unit.stepping is not None:
        return  # none; or a queued step owns it (it was stepped: `model.zero_grad()` after `opt.step()`)
    engine = info.state.engine
    engine.wait_grads()
    unit.has_grad[i] = False
    unit.grad_norms[i] = None
    if not any(unit.has_grad):  # as engine.zero_grad does for the whole unit
        engine.cache.drop(unit.name, keep=(PARAMS,))
        unit.life.on(Event.ZERO_GRAD)  # wait_grads: nothing is shipping


# ---- foreign optimizers --------------------------------------------------------------------------------------

def _tightfit_optimizer(opt) -> bool:
    from tightfit.optim import AdamW

    return isinstance(opt, AdamW)


_FOREIGN = ("{kind} {cls} over the parameters of a wrapped model: their gradients, master weights and moments live "
            "in the offload engine's tiers, where it would {what}; use tightfit.optim.AdamW(model.parameters(), ...) "
            "(and opt.clip_grad_norm_ for clipping)")


def _refuse_foreign_optimizer() -> None:
    """`p.is_leaf` is read by torch.optim.Optimizer.add_param_group for every parameter it is given: refuse there
    when the optimizer is not tightfit's (found as `self` of that frame)."""
    code = inspect.unwrap(torch.optim.Optimizer.add_param_group).__code__
    frame = sys._getframe(1)
    for _ in range(4):
        if frame is None:
            return
        if frame.f_code is code:
            opt = frame.f_locals.get("self")
            if opt is not None and not _tightfit_optimizer(opt):
                raise UsageError(_FOREIGN.format(kind="building", cls=type(opt).__name__, what="find nothing to step"))
            return
        frame = frame.f_back


def _refuse_foreign_step(opt, args, kwargs) -> None:
    """Global optimizer step pre-hook: an optimizer built before `wrap` steps nothing; refuse its step."""
    if not _SLOTS or _tightfit_optimizer(opt):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if info_of(p) is not None:
                raise UsageError(_FOREIGN.format(kind="stepping", cls=type(opt).__name__, what="change nothing"))


_step_hook = None


def install(state, units: list[OffloadUnit]) -> None:
    """Make every parameter of `units` an OffloadedParameter answering for `state` (module_state.ModuleState)."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_refuse_foreign_step)
    for unit in units:
        index = {id(s.param): i for i, s in enumerate(unit.trainable)}
        for slot in unit.spec.slots:
            p = slot.param
            _SLOTS[id(p)] = ParamInfo(state, unit, slot, index.get(id(p)), type(p))
            p.__class__ = _offloaded_class(type(p))


_CLASSES: dict[type, type] = {nn.Parameter: OffloadedParameter}


def _offloaded_class(cls: type) -> type:
    """OffloadedParameter, or for a Parameter subclass of the model's own a class deriving from both (its
    isinstance checks keep holding; this class's __torch_function__ comes first)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Offloaded{cls.__name__}", (OffloadedParameter, cls), {})
    return _CLASSES[cls]


def uninstall(units: list[OffloadUnit]) -> None:
    """Give the parameters their original class back (engine close)."""
    for unit in units:
        for slot in unit.spec.slots:
            info = _SLOTS.pop(id(slot.param), None)
            if info is not None:
                slot.param.__class__ = info.original_class
