"""A wrapped model's state dict: `state_dict()` gathers real tensors from the tiers, `load_state_dict` writes into them.

Why: `tightfit.wrap` returns the model itself, and whatever users and frameworks do next with an `nn.Module`
(`torch.save(model.state_dict())`, `save_pretrained`, peft's adapter save, `load_state_dict` of a checkpoint) goes
through torch's state-dict machinery, which reads and writes the parameters. Between uses those are views of freed
storage ([Note: flat buffer and storage resizing], step/unit.py). So, on every module of the model:

- `state_dict()`: a post-hook replaces each wrapped parameter's entry by a copy of its **fp32 master** values (the
  training truth, whatever the compute dtype), read from the master's tier (device, host or NVMe), one unit at a
  time: a unit's master is read once, and each parameter's entry is its own CPU tensor (tied names share one), so
  safetensors and `save_pretrained` see no false sharing. Keys are torch's own; buffers are left as torch puts them.
  The dict holds the whole model in fp32. For a model larger than host memory: `iter_state_dict` streams the same
  keys and values one unit at a time (`tightfit.models.hf_save.save_hf_model` writes a Hugging Face folder from it),
  and `deferred_state_dict` gives torch's keys with `Deferred` placeholders read when used, so that transformers'
  `save_pretrained(folder, state_dict=deferred_state_dict(model))` holds one shard at a time.
- `load_state_dict()`: a pre-hook *stages* each unit whose parameters are in the given dict: its fp32 master is
  read into a host buffer and the unit's parameters are pointed at views of it, so torch's own `_load_from_state_dict`
  copies the values in with its shape checks and strict / missing / unexpected semantics unchanged. A post-hook
  *commits* the unit once its modules are loaded (the outermost module for the root unit): `engine.write_master`
  writes master and compute copies to their tiers, and the parameters are pointed back at the flat buffer. Host
  memory: the loaded dict plus the staged units (one block, and the root unit until the end).

Reading a parameter outside forward/backward is wrapped_param.py's part; both are installed by `attach`, called
from `tightfit.wrap`, and removed with the engine (`engine.close`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn

from tightfit.errors import UsageError
from tightfit.offload.model_state import wrapped_param
from tightfit.offload.model_state.wrapped_param import _local, bypass, info_of
from tightfit.offload.runtime.aligned import aligned_empty
from tightfit.offload.step.unit import OffloadUnit

_STATES: weakref.WeakKeyDictionary[nn.Module, ModuleState] = weakref.WeakKeyDictionary()


class ModuleState:
    """The state-dict side of one wrapped model. Holds its engine (as the model's hooks do), never the model."""

    def __init__(self, engine, model: nn.Module) -> None:
        self.engine = engine
        units = list(engine.units.values())
        # Load sessions: unit name -> the fp32 master buffer its parameters point at while a load writes into them,
        # and each parameter's own view of the flat buffer, given back at commit. Both empty outside a load.
        self._staged: dict[str, torch.Tensor] = {}
        self._flat_views: dict[int, torch.Tensor] = {}
        self._load_root: weakref.ref | None = None  # the module whose load_state_dict call opened the session
        # id(last member module) -> units committed when that module's load is done ([Note: grouped blocks]).
        self._commit_after: dict[int, list[OffloadUnit]] = {}
        for unit in units:
            if unit.spec.members:
                self._commit_after.setdefault(id(unit.spec.modules[-1]), []).append(unit)
        # Read caches, for one unit each: (unit name, version, tensor). `_master`: the fp32 master a state_dict()
        # call is copying from; `_params`: the compute copy reads outside forward are served from. Dropped at the end
        # of the model's state_dict(), at its next forward and at close.
        self._master: tuple[str, int, torch.Tensor] | None = None
        self._params: tuple[str, int, torch.Tensor] | None = None
        self._tied: dict[int, tuple[int, torch.Tensor]] = {}  # id(param) -> (version, value) within one state_dict
        self._deferring = False  # within `deferred_state_dict`: placeholders instead of values
        self._sd_depth = 0  # state_dict() pre-hooks of this model whose post-hook has not run yet
        self._handles: list = []

    # ---- shared by both sides --------------------------------------------------------------------------------

    def settle(self) -> None:
        """Let every gradient, early step and write-back land, so the tiers hold the current values."""
        self.engine.wait_grads()
        self.engine.wait_steps()
        self.engine.wait_writes()

    def is_staged(self, unit: OffloadUnit) -> bool:
        return unit.name in self._staged

    def read_params(self, unit: OffloadUnit) -> torch.Tensor:
        """The unit's compute copy as a host tensor, from its tier (cached for the unit's current version)."""
        self.engine.wait_step(unit)
        if self._params is None or self._params[:2] != (unit.name, unit.version):
            self._params = None
            out = aligned_empty(unit.spec.numel, unit.compute_dtype)
            unit.read_params(out)
            self._params = (unit.name, unit.version, out)
        return self._params[2]

    def master_of(self, unit: OffloadUnit) -> torch.Tensor:
        if unit.name in self._staged:
            return self._staged[unit.name]
        self.engine.wait_step(unit)  # its version is then the one its values have
        if self._master is None or self._master[:2] != (unit.name, unit.version):
            self._master = None
            self._master = (unit.name, unit.version, self.engine.read_master(unit))
        return self._master[2]

    def drop_caches(self) -> None:
        self._master = self._params = None
        self._tied.clear()

    # ---- state_dict ------------------------------------------------------------------------------------------

    def value(self, p: nn.Parameter) -> torch.Tensor:
        """A new CPU tensor with the fp32 master values of wrapped parameter `p` (within one state_dict() call, one
        per parameter: its tied names share it). In a deferred state dict, a `Deferred` placeholder instead."""
        info = info_of(p)
        cached = self._tied.get(id(p))
        if cached is not None and cached[0] == info.unit.version:
            return cached[1]
        if self._deferring:
            out = Deferred.of(self, p)
        else:
            out = self.read_value(p)
        self._tied[id(p)] = (info.unit.version, out)
        return out

    def read_value(self, p: nn.Parameter) -> torch.Tensor:
        info = info_of(p)
        return info.slot.view(self.master_of(info.unit)).clone()

    def _on_state_dict_pre(self, module, prefix, keep_vars) -> None:
        if getattr(_local, "depth", 0) == 0:
            self.finish_load()
            self.settle()
            self._tied.clear()
        # Torch's `param.detach()` in `_save_to_state_dict` must not read the parameters: bypassed until this
        # module's post-hook. `_sd_depth` counts this model's share, taken back by its next forward if a state_dict()
        # call was cut short by an exception between the two hooks.
        _local.depth = getattr(_local, "depth", 0) + 1
        self._sd_depth += 1

    def _on_state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        try:
            for name, p in module._parameters.items():
                if p is not None and info_of(p) is not None and prefix + name in state_dict:
                    state_dict[prefix + name] = self.value(p)
        finally:
            _local.depth -= 1
            self._sd_depth -= 1
            if _local.depth == 0:
                self.drop_caches()  # the values are in the caller's dict now

    # ---- load_state_dict -------------------------------------------------------------------------------------

    def stage(self, unit: OffloadUnit) -> None:
        """Point the unit's parameters at a host copy of its fp32 master, for torch's loader to write into."""
        if unit.name in self._staged:
            return
        self.settle()
        master = self.engine.read_master(unit)
        with bypass():
            for slot in unit.spec.slots:
                self._flat_views[id(slot.param)] = slot.param.data
                slot.param.data = slot.view(master)
        self._staged[unit.name] = master

    def commit(self, unit: OffloadUnit) -> None:
        """Write a staged unit's values to its tiers and point its parameters back at the flat buffer."""
        master = self._staged.pop(unit.name, None)
        if master is None:
            return
        with bypass():
            for slot in unit.spec.slots:
                slot.param.data = self._flat_views.pop(id(slot.param))
        self.engine.write_master(unit, master)
        self.drop_caches()

    def finish_load(self) -> None:
        """Commit every staged unit (the end of a load, or the next use of the model after one that failed)."""
        for name in list(self._staged):
            self.commit(self.engine.units[name])
        self._load_root = None

    def _on_load_pre(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if self._load_root is None or self._load_root() is None:
            self._load_root = weakref.ref(module)
        for name, p in module._parameters.items():
            info = info_of(p) if p is not None else None
            if info is None or prefix + name not in state_dict:
                continue
            if local_metadata.get("assign_to_params_buffers"):
                self.finish_load()
                raise UsageError("load_state_dict(assign=True) would replace the parameters of a wrapped model, "
                                 "whose values live in the offload engine's tiers; call load_state_dict(state_dict) "
                                 "without assign, which writes the values into the tiers")
            self.stage(info.unit)

    def _on_load_post(self, module, incompatible_keys) -> None:
        if self._load_root is not None and self._load_root() is module:
            self.finish_load()
            return
        for unit in self._commit_after.get(id(module), ()):
            self.commit(unit)

    def _on_forward_pre(self, module, args, kwargs) -> None:
        if self._sd_depth:  # a state_dict() that raised between its hooks left the bypass on
            _local.depth = max(0, getattr(_local, "depth", 0) - self._sd_depth)
            self._sd_depth = 0
        self.finish_load()
        self.drop_caches()

    # ---- streaming -------------------------------------------------------------------------------------------

    def iter_state_dict(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(state_dict key, CPU tensor) for every key of `model.state_dict()`: parameters a unit at a time (fp32
        master values; the names of a tied parameter share one tensor), then the persistent buffers."""
        self.finish_load()
        self.settle()
        names: dict[int, list[str]] = {}
        buffers: list[tuple[str, torch.Tensor]] = []
        for path, module in model.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            for name, p in module._parameters.items():
                if p is not None:
                    names.setdefault(id(p), []).append(prefix + name)
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent_buffers_set:
                    buffers.append((prefix + name, b))
        for unit in self.engine.units.values():
            master = self.engine.read_master(unit)
            for slot in unit.spec.slots:
                value = slot.view(master).clone()
                for key in names.get(id(slot.param), ()):
                    yield key, value
            del master
        for key, b in buffers:
            yield key, b.detach().cpu()

    # ---- install / remove ------------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        units = list(self.engine.units.values())
        wrapped_param.install(self, units)
        # Plain functions, not bound methods: torch marks its public hooks with an attribute.
        def sd_pre(*a):
            self._on_state_dict_pre(*a)

        def sd_post(*a):
            self._on_state_dict_post(*a)

        def load_pre(*a):
            self._on_load_pre(*a)

        def load_post(*a):
            self._on_load_post(*a)

        for module in dict.fromkeys(model.modules()):
            self._handles += [module.register_state_dict_pre_hook(sd_pre),
                              module.register_state_dict_post_hook(sd_post),
                              module.register_load_state_dict_pre_hook(load_pre),
                              module.register_load_state_dict_post_hook(load_post)]
        self._handles.append(model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True, prepend=True))
        _STATES[model] = self

    def remove(self) -> None:
        """Undo `install` (engine close): staged values are committed first, while the tiers still exist."""
        try:
            self.finish_load()
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            wrapped_param.uninstall(list(self.engine.units.values()))
            self.drop_caches()


class Deferred(torch.Tensor):
    """A state-dict value not read yet: a meta tensor of the parameter's shape and fp32 that reads the parameter's
    master from its tier when anything but its metadata is asked of it (`.contiguous()`, which `save_pretrained` calls
    per shard, or any other op, applied to the value read). Holds the parameter until then, and the value after."""

    @staticmethod
    def of(state: ModuleState, p: nn.Parameter) -> Deferred:
        with bypass():
            meta = torch.empty(p.shape, dtype=torch.float32, device="meta")
        out = meta.as_subclass(Deferred)
        out._source = (state, p)  # this placeholder's own attributes; nothing is stored on the parameter
        out._value = None
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__") or name in wrapped_param._METADATA or name in ("__repr__", "nbytes"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def real(a):
            if isinstance(a, Deferred):
                # Read once per placeholder: repeated uses see one tensor (transformers compares the end pointers of
                # tied names, `view(-1)[-1].data_ptr()`); it lives as long as the placeholder does.
                if a._value is None:
                    state, p = a._source
                    a._value = state.read_value(p)
                return a._value
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        with torch._C.DisableTorchFunctionSubclass():
            return func(*real(tuple(args)), **{k: real(v) for k, v in kwargs.items()})


def deferred_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every wrapped parameter's value a `Deferred` placeholder, read from its tier (one
    unit at a time) only when used: for `model.save_pretrained(folder, state_dict=deferred_state_dict(model))`,
    which then holds one shard in memory, not the model. Torch's keys (and any module's own state-dict hooks)."""
    state = _STATES.get(model)
    if state is None:
        return model.state_dict()
    state._deferring = True
    try:
        return model.state_dict()
    finally:
        state._deferring = False


def attach(model: nn.Module, engine) -> ModuleState:
    """Make the wrapped `model` answer as an nn.Module (state dicts, parameter reads); undone by `engine.close()`."""
    state = ModuleState(engine, model)
    state.install(model)
    engine.on_close.append(state.remove)
    return state


def iter_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `model.state_dict()`'s keys and values one unit at a time (a wrapped model: fp32 masters read from the
    tiers; any other model: its own tensors). Memory: one unit. For saving a model larger than host memory."""
    state = _STATES.get(model)
    if state is None:
        yield from model.state_dict().items()
        return
    yield from state.iter_state_dict(model)
