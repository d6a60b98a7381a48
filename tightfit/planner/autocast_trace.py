"""Autocast on the meta device, for the planner's trace: the casts a mixed-precision step really makes.

`tightfit train` (and the Hugging Face Trainer with `bf16=True`) runs a bf16 or fp16 step under `torch.autocast`,
which casts each op's inputs by the op's list: matmuls and convolutions down to the compute dtype, reductions,
norms, softmax and losses up to fp32. On meta tensors `torch.autocast` does nothing (no backend's autocast key is
set on them), so the trace saw none of those casts. The default model (4 blocks of width 128) on an H200 showed
what that costs: 169 aten ops traced per micro-batch where its bf16 step under CUDA's autocast dispatches 259, each
missing one a kernel launch and 16 us of the host's time, and the step, bound by the host, 33% slower than
predicted (benchmarks/RESULTS.md, batch AE).

`MetaAutocast` makes the same casts one level above autograd, where autocast itself sits: a TorchFunctionMode sees
each call (`F.linear`, `Tensor.softmax`, `F.layer_norm`, ...), casts its floating tensor arguments by the call's
list with `Tensor.to`, and calls it. Autograd records each cast, so the trace counts the casts of forward and their
backward, the bytes and the saved tensors (a linear saves its bf16 input copy, as under autocast). Fp32 leaves cast
down are cast once per forward, as autocast's weight cache does. The lists are PyTorch's (torch/csrc/autograd/
autocast_mode.cpp, the tables in docs/amp.rst) at the torch-function level: a Python-level function such as
`F.cross_entropy` stands for the aten op autocast registers (`cross_entropy_loss`); ops the lists leave out run
as they are given.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Down to the compute dtype.
_LOWER_COMMON = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addbmm", "baddbmm", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "linalg_vecdot",
})
LOWER = {
    "cuda": _LOWER_COMMON | {"addmv", "addr", "chain_matmul", "linalg_multi_dot", "multi_dot", "mv", "einsum"},
    "cpu": _LOWER_COMMON,
}
# Up to fp32.
_FP32_LOSSES = frozenset({
    "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits",
    "cosine_embedding_loss", "hinge_embedding_loss", "poisson_nll_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "cdist",
})
FP32 = {
    "cuda": _FP32_LOSSES | {
        "__pow__", "__rpow__", "__rtruediv__", "__rdiv__", "pow", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
        "exp", "expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "softplus", "layer_norm",
        "group_norm", "dist", "pdist", "renorm", "cosine_similarity", "logsumexp"},
    # CPU's list names the loss itself; CUDA's reaches it through log_softmax and nll_loss (`_cuda_cross_entropy`).
    "cpu": _FP32_LOSSES | {"cross_entropy", "binary_cross_entropy", "ctc_loss", "quantile", "nanquantile", "trace",
                           "stft", "prod"},
}
# Told to compute in fp32 (the op's `dtype` argument, where none was given): CUDA's reductions and softmax.
FP32_BY_DTYPE = {
    "cuda": frozenset({"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod", "linalg_vector_norm",
                       "linalg_matrix_norm"}),
    "cpu": frozenset(),
}
# To the widest floating dtype among the inputs.
PROMOTE = {
    "cuda": frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add",
                       "tensordot", "grid_sample"}),
    "cpu": frozenset({"stack", "cat", "index_copy"}),
}
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class MetaAutocast(TorchFunctionMode):
    """`torch.autocast(device_type, dtype)`'s casts, made by hand so that they happen on meta tensors too.

    Enter it inside any other function mode of the trace: the innermost mode sees a call first, so the modes below
    (the fused-attention router) see the cast arguments, as the dispatcher's kernels do under autocast."""

    def __init__(self, dtype: torch.dtype, device_type: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.cuda = device_type == "cuda"
        kind = "cuda" if self.cuda else "cpu"
        self.lower, self.fp32, self.promote = LOWER[kind], FP32[kind], PROMOTE[kind]
        self.by_dtype = FP32_BY_DTYPE[kind]
        self._leaf_casts: dict[int, torch.Tensor] = {}  # id(fp32 leaf) -> its cast, for one forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "cross_entropy" and self.cuda:
            return _cuda_cross_entropy(func, args, kwargs)
        if name in self.lower:
            to = self.dtype
        elif name in self.fp32:
            to = torch.float32
        elif name in self.by_dtype:
            first = next(_tensors(args, {}), None)
            if kwargs.get("dtype") is not None or first is None or first.dtype not in (torch.float16, torch.bfloat16):
                return func(*args, **kwargs)  # an op told its dtype (or given fp32) runs as told
            return func(*args, **{**kwargs, "dtype": torch.float32})
        elif name in self.promote:
            floats = [t.dtype for t in _tensors(args, kwargs) if t.dtype in _CASTABLE]
            if len(set(floats)) < 2:
                return func(*args, **kwargs)
            to = max(floats, key=lambda d: torch.finfo(d).bits)
        else:
            return func(*args, **kwargs)
        cast = lambda t: self._cast(t, to)
        return func(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})

    def _cast(self, t, to: torch.dtype):
        if not isinstance(t, torch.Tensor) or t.dtype not in _CASTABLE or t.dtype == to:
            return t
        if t.is_leaf and t.requires_grad and t.dtype == torch.float32 and to != torch.float32:
            # Autocast's cache: a weight is cast once per forward, not once per use.
            hit = self._leaf_casts.get(id(t))
            if hit is None:
                hit = self._leaf_casts[id(t)] = t.to(to)
            return hit
        return t.to(to)


def _cuda_cross_entropy(func, args, kwargs):
    """`F.cross_entropy` under CUDA's autocast: the loss has no entry of its own there, so autocast meets the ops it
    decomposes into, `log_softmax` (told fp32: one fp32 output from the low-precision logits, no cast copy of them)
    and `nll_loss` (fp32). Class-index targets without label smoothing; anything else is cast to fp32 whole."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    given = {**dict(zip(names, args)), **kwargs}
    x, target = given.get("input"), given.get("target")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16):
        return func(*args, **kwargs)
    if given.get("label_smoothing", 0.0) or not isinstance(target, torch.Tensor) or target.is_floating_point() or \
            given.get("size_average") is not None or given.get("reduce") is not None:
        return func(*_map(args, _up), **{k: _map(v, _up) for k, v in kwargs.items()})
    weight = given.get("weight")
    logp = x.log_softmax(1 if x.dim() >= 2 else 0, dtype=torch.float32)
    return torch.nn.functional.nll_loss(logp, target, None if weight is None else _up(weight),
                                        ignore_index=given.get("ignore_index", -100),
                                        reduction=given.get("reduction", "mean"))


def _up(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) else t


def _tensors(args, kwargs):
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _map(a, fn):
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        return type(a)(fn(t) if isinstance(t, torch.Tensor) else t for t in a)
    return a
