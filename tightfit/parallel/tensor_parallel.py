"""Tensor parallelism over the mesh's `tp` dimension: `apply_tp` with Megatron-style plans per model family.

Each transformer block is split the same way (Megatron-LM, sec. 3):
- attention: the q/k/v projections column-parallel (each rank computes n_head/tp whole heads, attention itself
  needs no communication), the output projection row-parallel (one all-reduce of the block's output);
- MLP: up (and Llama's gate) column-parallel, down row-parallel (one all-reduce).
So a block costs two all-reduces of [B, T, C] activations in forward and two in backward. The token embedding is
split by vocabulary rows (row-parallel, one all-reduce) and the LM head by vocabulary columns with the logits
gathered (column-parallel, Replicate output), because at GPT-2/Llama sizes these are the largest single matrices.
Norms stay replicated: their gradients are identical on every tp rank because their inputs and upstream gradients
are (the row-parallel all-reduce makes them so).

The models need no changes because they reshape with `view(B, T, -1, head_dim)`: the head count follows the
width of the local shard. Plans exist for:
- the reference GPT (tightfit.models.gpt): separate q/k/v/o projections and up/down MLP, nn.Linear throughout;
- Hugging Face Llama (and Mistral/Qwen2-style) decoder layers: q/k/v/o_proj, gate/up/down_proj; kv heads must
  also divide by tp;
- Hugging Face GPT-2: its layers are `Conv1D` (weight stored [in, out], the transpose of nn.Linear) and attention
  uses one fused `c_attn` producing [q | k | v]. Conv1D is handled by styles that shard weight dim 1 (column) or
  dim 0 (row). A plain column split of the fused matrix would give rank 0 all of q and part of k, so `c_attn` is
  sharded with `_StridedShard(1, split_factor=3)`: each of q, k, v is split across ranks and rank r holds
  [q_r | k_r | v_r] — the layout the module's own `split(split_size)` expects once `split_size` is set to the
  local width. `full_tensor(t)` below (checkpoints) returns the original [q | k | v] order. Its forward multiplies
  the local shards itself: DTensor's own ops on a `_StridedShard` weight need a redistribution in backward that
  torch before 2.13 cannot plan (2.11: "unable to be interpreted into a corresponding shard_order"), and the
  local product is all they would compute. The input's gradient is all-reduced over tp, as ColwiseParallel does.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from tightfit.errors import UsageError

try:  # private in torch; only the packed q|k|v of HF GPT-2 (Conv1DColwise(fused=3)) needs it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:
    _StridedShard = None


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's transposed linear layer (transformers.pytorch_utils.Conv1D), detected without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class Conv1DColwise(ColwiseParallel):
    """Column-parallel style for HF Conv1D: weight [in, out] sharded on dim 1; `fused` > 1 for packed outputs."""

    def __init__(self, fused: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def _placement(self, dim: int):
        if self.fused > 1 and _StridedShard is None:
            raise UsageError(f"tensor parallelism of packed projections (HF GPT-2's c_attn) needs "
                             f"torch.distributed.tensor's _StridedShard, missing from torch {torch.__version__}: "
                             "use the torch version pyproject.toml names, or --strategy zero3")
        return _StridedShard(dim, split_factor=self.fused) if self.fused > 1 else Shard(dim)

    def _partition_conv1d_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            place = self._placement(1 if pname == "weight" else 0)
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [place]),
                                                          requires_grad=param.requires_grad))

    @staticmethod
    def _conv1d_output_fn(mod, outputs, device_mesh):
        # Whatever placement propagation chose for the packed output, the local block is this rank's columns.
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    @staticmethod
    def _replicated_local_input_fn(mod, inputs, device_mesh):
        """The replicated input as a local tensor whose gradient (a partial sum per rank) is all-reduced over tp."""
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        return (x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),)), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        from functools import partial

        if self.fused > 1:
            module.forward = partial(_local_conv1d_forward, module)
            return distribute_module(module, device_mesh, self._partition_conv1d_fn,
                                     self._replicated_local_input_fn)
        return distribute_module(module, device_mesh, self._partition_conv1d_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 self._conv1d_output_fn)


def _local_conv1d_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF Conv1D's forward on this rank's shards (x local and replicated; the output is this rank's columns)."""
    weight, bias = module.weight.to_local(), module.bias.to_local()
    return torch.addmm(bias, x.reshape(-1, x.size(-1)), weight).view(*x.shape[:-1], weight.shape[1])


class Conv1DRowwise(RowwiseParallel):
    """Row-parallel style for HF Conv1D: weight [in, out] sharded on dim 0, bias replicated."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            place = Shard(0) if pname == "weight" else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [place]),
                                                          requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        from functools import partial

        self.desired_input_layouts = (Shard(-1),)  # the input's last (feature) dim arrives split, as for Linear
        return distribute_module(module, device_mesh, self._partition_conv1d_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _packed(placements, mesh: DeviceMesh) -> list[int]:
    """Mesh dims holding a packed projection's `_StridedShard` (Conv1DColwise(fused=...)). DTensor's own
    `_StridedShard` (FSDP2 over a TP shard) has a split factor equal to the number of pieces the later mesh dims
    cut the same tensor dim into; a packed one's factor is the packing (3 for q|k|v), which nothing explains."""
    out = []
    for m, p in enumerate(placements):
        if _StridedShard is not None and isinstance(p, _StridedShard):
            later = [mesh.size(k) for k in range(m + 1, len(placements))
                     if getattr(placements[k], "dim", None) == p.dim]
            if p.split_factor != math.prod(later):
                out.append(m)
    return out


def _as_plain(placements, packed: list[int], mesh: DeviceMesh) -> list:
    """The placements with each packed one as a plain Shard. Tensor parallelism shards before FSDP2 does, so an
    earlier mesh dim sharding the same tensor dim splits each rank's TP shard: in DTensor's terms a `_StridedShard`
    whose factor is the pieces of the later mesh dims (torch 2.13's FSDP2 labels it so; 2.11's labels it Shard)."""
    out = [Shard(p.dim) if m in packed else p for m, p in enumerate(placements)]
    for m in packed:
        d = out[m].dim
        for k in range(m):
            if getattr(out[k], "dim", None) == d:
                later = [mesh.size(j) for j in range(k + 1, len(out)) if getattr(out[j], "dim", None) == d]
                out[k] = _StridedShard(d, split_factor=math.prod(later))
    return out


def on_mesh_device(t: DTensor) -> DTensor:
    """`t` with its local tensor on its mesh's device type, as a collective over the mesh needs it: FSDP2's CPU
    offload keeps shards and their gradients in host memory on a CUDA mesh, whose NCCL collectives refuse a CPU
    tensor (pytorch#148532: the clip's norm; a checkpoint's gather). The same DTensor where they already agree."""
    local = t.to_local()
    if local.device.type == t.device_mesh.device_type:
        return t
    return DTensor.from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def full_tensor(t: DTensor) -> torch.Tensor:
    """`t.full_tensor()`, also for a packed projection's placement. DTensor cannot gather that one where it alone
    shards its dim (torch before 2.13: "unable to be interpreted into a corresponding shard_order"), and gathers
    it wrongly next to FSDP2's shard of the same dim. It is gathered as a plain Shard instead, giving [n ranks,
    split_factor, width] along its dim, and put back in [split_factor, n, width] order. Collective; a shard in host
    memory on a GPU mesh is gathered on the GPU (`on_mesh_device`)."""
    t = on_mesh_device(t)
    mesh = t.device_mesh
    packed = _packed(t.placements, mesh)
    if not packed:
        return t.full_tensor()
    full = DTensor.from_local(t.to_local(), mesh, _as_plain(t.placements, packed, mesh), run_check=False, shape=t.shape,
                              stride=t.stride()).full_tensor()
    for m in packed:
        d, sf = t.placements[m].dim, t.placements[m].split_factor
        full = full.unflatten(d, (mesh.size(m), sf, -1)).transpose(d, d + 1).flatten(d, d + 2)
    return full


def distribute_like(value: torch.Tensor, like: DTensor) -> DTensor:
    """A full `value` (every rank holds it) sliced locally into a DTensor placed like `like`, no collective: the
    inverse of `full_tensor`, packed placements included."""
    mesh, placements = like.device_mesh, like.placements
    packed = _packed(placements, mesh)
    if not packed:
        return distribute_tensor(value, mesh, placements, src_data_rank=None)
    for m in packed:
        d, sf = placements[m].dim, placements[m].split_factor
        value = value.unflatten(d, (sf, mesh.size(m), -1)).transpose(d, d + 1).flatten(d, d + 2)
    local = distribute_tensor(value, mesh, _as_plain(placements, packed, mesh), src_data_rank=None).to_local()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


def _reference_gpt_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    return {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


def _llama_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def _gpt2_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    return {"attn.c_attn": Conv1DColwise(fused=3), "attn.c_proj": Conv1DRowwise(),
            "mlp.c_fc": Conv1DColwise(), "mlp.c_proj": Conv1DRowwise()}


def block_plan(block: nn.Module) -> tuple[str, dict[str, ParallelStyle]]:
    """(family, plan) for one transformer block, recognised by its submodule names."""
    names = {n for n, _ in block.named_modules()}
    if {"attn.q_proj", "attn.o_proj", "mlp.up", "mlp.down"} <= names:
        return "reference-gpt", _reference_gpt_plan(block)
    if {"self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"} <= names:
        return "llama", _llama_plan(block)
    if {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"} <= names:
        return "gpt2", _gpt2_plan(block)
    raise UsageError(f"tensor parallelism: no plan for blocks of type {type(block).__name__}; supported: the "
                     "reference GPT, Hugging Face GPT-2 and Llama-style blocks (use zero3 or pp for others)")


def _check_heads(block: nn.Module, family: str, tp: int) -> None:
    """Every rank must get whole heads (and whole kv heads)."""
    for mod in block.modules():
        for attr in ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads"):
            n = getattr(mod, attr, None) or getattr(getattr(mod, "config", None), attr, None)
            if isinstance(n, int) and n % tp:
                raise UsageError(f"--tp {tp}: must divide the number of heads ({attr}={n}) of the {family} blocks")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, blocks: list[nn.Module] | None = None) -> nn.Module:
    """Shard `model`'s transformer blocks (and its embedding and LM head, when present) over `tp_mesh`, in place.

    `blocks` defaults to the model's repeated blocks; `model` may be a pipeline stage holding some of them.
    """
    from tightfit.parallel.data_parallel import repeated_blocks

    tp = tp_mesh.size()
    blocks = repeated_blocks(model) if blocks is None else blocks
    if not blocks:
        raise UsageError("tensor parallelism: the model has no `blocks`/`layers`/`h` list of transformer blocks")
    for block in blocks:
        family, plan = block_plan(block)
        _check_heads(block, family, tp)
        parallelize_module(block, tp_mesh, plan)
        if family == "gpt2":
            # The fused c_attn now yields [q_r | k_r | v_r] of width 3*C/tp; split it at the local width.
            block.attn.split_size = block.attn.embed_dim // tp
    # Embedding rows (vocabulary) and LM-head columns: the two largest matrices outside the blocks.
    outer: dict[str, ParallelStyle] = {}
    for name, mod in model.named_modules():
        leaf = name.split(".")[-1]
        if isinstance(mod, nn.Embedding) and leaf in ("tok_emb", "embed_tokens", "wte") \
                and mod.num_embeddings % tp == 0:
            outer[name] = RowwiseParallel(input_layouts=Replicate())
        elif isinstance(mod, nn.Linear) and leaf in ("head", "lm_head") and mod.out_features % tp == 0:
            outer[name] = ColwiseParallel(output_layouts=Replicate())
    tied = _tied(model)
    outer = {k: v for k, v in outer.items() if k not in tied}
    if outer:
        parallelize_module(model, tp_mesh, outer)
    return model


def _tied(model: nn.Module) -> set[str]:
    """Modules whose weight is shared with another module (tied embeddings): left replicated."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, nn.Parameter):
            if id(w) in seen:
                tied.update((name, seen[id(w)]))
            seen.setdefault(id(w), name)
    return tied
