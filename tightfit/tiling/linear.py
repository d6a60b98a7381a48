"""`TiledLinear`: one `nn.Linear` stored and computed as a grid of smaller tiles.

Why: offloading moves whole units, so the largest single layer sets the smallest device that can train a model. A
Linear whose weight and gradient do not fit the device budget (a 128k-vocabulary head, a very wide MLP projection)
must be cut. Splitting the weight [out, in] into a grid of tiles [out_o, in_i] lets an offload engine fetch one
tile, compute its partial product, release it and fetch the next, so only one tile (plus its gradient) is resident.

Layout, chosen for the offload engine's unit detector (children of an `nn.ModuleList` that share a class):

    TiledLinear
      tiles: ModuleList[LinearTile]       # out_splits * in_splits tiles, row-major: tile k = (o, i), k = o*in_splits+i
        LinearTile.weight  [out_o, in_i]  # one contiguous parameter per tile: the unit that moves
        LinearTile.bias    [out_o]        # only on the first tile of each output row (i == 0), else None

Each tile is its own unit (a flat list, not one unit per output row): an output row of a 128k x 8k head is still
the size of the whole problem when the grid is all rows. Tiles are called as modules (`tile(x_i)`), never read as
bare tensors, so an engine's forward and backward hooks on each tile fire in the order the tiles are used.

Forward, for x [..., in] split into slices x_i [..., in_i] (views, no copy):

    y_o = sum_i x_i @ W_oi^T + b_o      # [..., out_o]
    y   = cat_o y_o                     # [..., out]

Numerics: output splits do not change any dot product. Input splits change the summation order of each dot product
(one fp32 rounding per extra split), about 1e-7 relative in fp32. Under autocast each partial product is rounded to
bf16/fp16 by its matmul, then the partials are added in fp32 and rounded once more; still a little worse than one
matmul, so `plan_tiles` prefers output splits.

Checkpoints: `state_dict()` gathers the tiles into a plain Linear's `weight` [out, in] and `bias` [out], and
`load_state_dict()` accepts those keys (or the native `tiles.*` keys), so a model saves and loads the same files
tiled or not. Gathering materialises one full weight for the duration of the save.

Hugging Face `Conv1D` (GPT-2, GPT-J's ancestors): a Linear whose weight is stored transposed, [in, out], computed
as `addmm(b, x, W)`. `TiledLinear(..., transposed=True)` (`from_conv1d`) keeps that layout in every tile (weight
[in_i, out_o]) and that kernel, so an output-split tile computes its columns exactly as the Conv1D did, and its
checkpoint keys are the Conv1D's [in, out].

`.weight` / `.bias`: code written for the layer it replaced reads them (T5's feed-forward checks `wo.weight.dtype`
before calling `wo`). They return the full tensors in the replaced layer's layout, gathered from the tiles: a new
tensor each read (the whole weight is materialised for as long as the caller holds it), not a Parameter, not
tracked by autograd. Where an offload engine has released the tiles (their unit is not materialised, the usual
case inside the owner's forward), there are no values to gather: the read returns a tensor of the full shape and
the tiles' dtype on the meta device, which answers shape and dtype questions and fails loudly if computed with.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tightfit.errors import UsageError


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `parts` near-equal slices of `n` (the first `n % parts` get one more), like `torch.tensor_split`."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class LinearTile(nn.Module):
    """One tile of a `TiledLinear`: weight [out_o, in_i] and, on the first tile of a row, bias [out_o].

    transposed: the tile of a Conv1D, weight [in_i, out_o], computed with the Conv1D's own `addmm`.
    A class of its own (not an `nn.Linear`) so transforms that look for `nn.Linear` (tiling itself, tensor
    parallel plans, size planners) never mistake a tile for a layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None,
                 transposed: bool = False) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.transposed = transposed
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(*shape, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)  # [..., in_i] -> [..., out_o]
        # Conv1D's kernel: [N, in_i] @ [in_i, out_o] (+ b). reshape, not view: x may be a narrowed input slice.
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(self.bias, x2, self.weight) if self.bias is not None else torch.mm(x2, self.weight)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", transposed=True" if self.transposed else ""))


class TiledLinear(nn.Module):
    """Drop-in `nn.Linear(in_features, out_features, bias)` stored as `out_splits x in_splits` tiles.

    `in_splits` / `out_splits` may not divide the features; slices then differ by one (see `split_sizes`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        in_splits: int = 1,
        out_splits: int = 1,
        bias: bool = True,
        device=None,
        dtype=None,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        for name, splits, feats in (("in_splits", in_splits, in_features), ("out_splits", out_splits, out_features)):
            if not isinstance(splits, int) or not 1 <= splits <= feats:
                raise UsageError(f"TiledLinear: {name} must be an integer in [1, {feats}], got {splits!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.transposed = transposed  # a Conv1D's: tiles and checkpoint keys hold weights as [in, out]
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        self.in_offsets = _offsets(self.in_sizes)
        self.out_offsets = _offsets(self.out_sizes)
        self.tiles = nn.ModuleList(
            LinearTile(i_size, o_size, bias and i == 0, device=device, dtype=dtype, transposed=transposed)
            for o_size in self.out_sizes
            for i, i_size in enumerate(self.in_sizes)
        )
        self.reset_parameters()
        # Checkpoint compatibility with nn.Linear: save as `weight`/`bias`, accept them on load.
        self.register_state_dict_post_hook(_save_as_linear)
        self.register_load_state_dict_pre_hook(_load_from_linear)

    @property
    def has_bias(self) -> bool:
        return self.tiles[0].bias is not None

    @property
    def weight(self) -> torch.Tensor:
        """The full weight in the replaced layer's layout ([out, in]; a Conv1D's [in, out]), gathered: see the
        module docstring (a copy, no autograd; a meta tensor of that shape where an engine released the tiles)."""
        if not self._materialised():
            w = self.tiles[0].weight
            shape = (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)
            return torch.empty(shape, dtype=w.dtype, device="meta")
        w = self.gathered_weight()
        return w.t().contiguous() if self.transposed else w

    @property
    def bias(self) -> torch.Tensor | None:
        """The full bias [out], gathered (a copy; a meta tensor where an engine released the tiles), or None."""
        if not self.has_bias:
            return None
        if not self._materialised():
            return torch.empty(self.out_features, dtype=self.tiles[0].bias.dtype, device="meta")
        return self.gathered_bias()

    def _materialised(self) -> bool:
        """Whether every tile holds its values. An offload engine releases a unit by resizing the storage under its
        parameters to 0 bytes (shapes kept): reading such a parameter would read freed memory."""
        return all(p.device.type == "meta"
                   or p.untyped_storage().nbytes() >= (p.storage_offset() + p.numel()) * p.element_size()
                   for p in self.parameters())

    def tile(self, o: int, i: int) -> LinearTile:
        """The tile holding output slice `o` and input slice `i`."""
        return self.tiles[o * self.in_splits + i]

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the whole layer: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.

        Each tile must use the fan-in of the *whole* layer, not its own slice, to get nn.Linear's distribution.
        """
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for t in self.tiles:
                if t.weight.device.type == "meta":
                    continue
                t.weight.uniform_(-bound, bound)
                if t.bias is not None:
                    t.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise UsageError(f"TiledLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        # x_i [..., in_i]: a view of x (no copy), made afresh for every tile call. [Note: one input per tile] An
        # offload engine releases a unit once the gradient of the unit's *inputs* is complete; a tensor shared by
        # several tiles only completes after all of them ran backward, which would keep the whole layer resident.
        # With its own view, a tile's input gradient completes right after that tile's backward.
        def x_(i: int) -> torch.Tensor:
            return x.narrow(-1, self.in_offsets[i], self.in_sizes[i])

        ys = []
        for o in range(self.out_splits):
            y = self.tile(o, 0)(x_(0))  # [..., out_o], carries the bias
            if self.in_splits > 1:
                # Partial sums of bf16/fp16 outputs (autocast) are added in fp32 and rounded once at the end.
                out_dtype = y.dtype
                if out_dtype in (torch.float16, torch.bfloat16):
                    y = y.float()
                for i in range(1, self.in_splits):
                    # Out of place on purpose: an engine's full backward hooks on a tile wrap its output in a view
                    # that may not be modified in place. Costs one transient [..., out_o] buffer.
                    y = y + self.tile(o, i)(x_(i))  # promotes a bf16 partial to y's fp32
                y = y.to(out_dtype)
            ys.append(y)
        # The row outputs are freed after the cat: cat's backward only slices the incoming gradient.
        return ys[0] if self.out_splits == 1 else torch.cat(ys, dim=-1)  # [..., out]

    # ---- conversion to and from nn.Linear ---------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Module, in_splits: int = 1, out_splits: int = 1) -> "TiledLinear":
        """A TiledLinear holding a copy of `linear`'s parameters (same device, dtype and requires_grad).

        `linear`: an `nn.Linear`, or a Hugging Face `Conv1D` (tiled with `transposed=True`).
        Memory: the tiles are copies, so the weight exists twice until the caller drops `linear`.
        """
        feats = linear_features(linear)
        if feats is None:
            raise UsageError(f"TiledLinear.from_linear: expected an nn.Linear or a Hugging Face Conv1D, got "
                             f"{type(linear).__name__}")
        transposed = not isinstance(linear, nn.Linear)
        w = linear.weight  # [out, in], or [in, out] when transposed
        tiled = cls(
            *feats, in_splits, out_splits,
            bias=linear.bias is not None, device="meta", dtype=w.dtype, transposed=transposed,
        )
        # Built on meta (no init cost), then each tile takes its slice of the real weight.
        with torch.no_grad():
            for o, (oo, os_) in enumerate(zip(tiled.out_offsets, tiled.out_sizes)):
                for i, (io, is_) in enumerate(zip(tiled.in_offsets, tiled.in_sizes)):
                    t = tiled.tile(o, i)
                    piece = w[io:io + is_, oo:oo + os_] if transposed else w[oo:oo + os_, io:io + is_]
                    t.weight = nn.Parameter(piece.clone(), requires_grad=w.requires_grad)
                    if t.bias is not None:
                        b = linear.bias
                        t.bias = nn.Parameter(b[oo:oo + os_].clone(), requires_grad=b.requires_grad)
        tiled.train(linear.training)
        return tiled

    def gathered_weight(self) -> torch.Tensor:
        """The full weight [out, in] (Linear layout, also for a Conv1D's tiles) assembled from the tiles (a new
        tensor; not tracked by autograd)."""
        with torch.no_grad():
            if self.transposed:  # tile (o, i) holds [in_i, out_o]
                cols = [torch.cat([self.tile(o, i).weight for i in range(self.in_splits)], dim=0)
                        for o in range(self.out_splits)]
                return torch.cat(cols, dim=1).t()
            rows = [torch.cat([self.tile(o, i).weight for i in range(self.in_splits)], dim=1)
                    for o in range(self.out_splits)]
            return torch.cat(rows, dim=0)

    def gathered_bias(self) -> torch.Tensor | None:
        """The full bias [out] assembled from the tiles, or None."""
        if not self.has_bias:
            return None
        with torch.no_grad():
            return torch.cat([self.tile(o, 0).bias for o in range(self.out_splits)])

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the same parameters (copies; a Conv1D's weight transposed into Linear layout)."""
        w = self.tiles[0].weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.has_bias, device="meta", dtype=w.dtype)
        lin.weight = nn.Parameter(self.gathered_weight().contiguous(), requires_grad=w.requires_grad)
        if self.has_bias:
            lin.bias = nn.Parameter(self.gathered_bias(), requires_grad=self.tiles[0].bias.requires_grad)
        lin.train(self.training)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}"
                + (", transposed=True" if self.transposed else ""))


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a layer `TiledLinear` can replace: an `nn.Linear`, or a Hugging Face
    `Conv1D` (detected without importing transformers: its class name and `nf`/`nx`); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return module.nx, module.nf
    return None


# ---- state-dict hooks (module-level functions: the public hook API tags the callable, which a bound method refuses)


def _save_as_linear(module: TiledLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """Replace the `tiles.*` entries by a plain Linear's `weight` [out, in] and `bias` [out]."""
    tile_prefix = prefix + "tiles."
    tile_keys = [k for k in state_dict if k.startswith(tile_prefix)]
    if not tile_keys:
        return
    for k in tile_keys:
        del state_dict[k]
    # Entries are detached like nn.Module.state_dict's own (keep_vars=True cannot return tiles as one Parameter).
    w = module.gathered_weight()
    state_dict[prefix + "weight"] = w.t().contiguous() if module.transposed else w
    if module.has_bias:
        state_dict[prefix + "bias"] = module.gathered_bias()


def _load_from_linear(module: TiledLinear, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs) -> None:
    """Rewrite a plain Linear's `weight`/`bias` entries into per-tile entries (views, copied by load_state_dict)."""
    wkey, bkey = prefix + "weight", prefix + "bias"
    if wkey not in state_dict:
        return  # native tiles.* keys, or missing: load_state_dict reports what is missing
    w = state_dict.pop(wkey)
    b = state_dict.pop(bkey, None)
    want = (module.in_features, module.out_features) if module.transposed else (module.out_features,
                                                                                 module.in_features)
    if tuple(w.shape) != want:
        error_msgs.append(f"size mismatch for {wkey}: copying a param with shape {tuple(w.shape)} from checkpoint, "
                          f"the shape in current model is {want}.")
        return
    # load_state_dict(assign=True) makes the entries the parameters: give each tile its own storage then, rather
    # than a strided view that keeps the whole checkpoint weight alive.
    own = (lambda t: t.clone()) if local_metadata.get("assign_to_params_buffers", False) else (lambda t: t)
    for o, (oo, os_) in enumerate(zip(module.out_offsets, module.out_sizes)):
        for i, (io, is_) in enumerate(zip(module.in_offsets, module.in_sizes)):
            k = o * module.in_splits + i
            piece = w[io:io + is_, oo:oo + os_] if module.transposed else w[oo:oo + os_, io:io + is_]
            state_dict[f"{prefix}tiles.{k}.weight"] = own(piece)
            if i == 0 and b is not None:
                state_dict[f"{prefix}tiles.{k}.bias"] = own(b[oo:oo + os_])
    if b is not None and not module.has_bias:
        unexpected_keys.append(bkey)
