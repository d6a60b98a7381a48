"""`tile_linears`: replace oversized `nn.Linear` layers of a model by `TiledLinear`, in place.

Why a transform: tiling, like offload and parallelism, is applied from outside the model (the model file knows
nothing of it). The planner decides which Linears need tiles — those whose parameters and gradient exceed what the
device tier can hold for one unit — and records them in `Placement.tiled_linears` (module path -> number of
tiles); `tile_linears(model, tiles=placement.tiled_linears)` applies exactly that before the engine wraps the model,
after which every `LinearTile` is its own offload unit (`tile_paths` lists them).

How a budget becomes a grid (`plan_tiles`):
- a tile's cost is its parameters plus their gradient: 2 * dtype_bytes * rows * (cols + 1), the +1 counting the
  bias conservatively;
- the grid uses the fewest tiles that fit, and among grids of that count the most output splits (`grid_for_count`):
  output splits leave every dot product whole (no partial sums, no extra rounding). Only when that would leave
  tiles thinner than `MIN_TILE_ROWS` rows does it take the most square grid instead, because thin tiles make thin,
  slow matmuls (see docs/TILING.md, "What tiling costs");
- a tile count alone determines the grid (`grid_for_count`), so the count stored in a Placement reproduces the grid
  `plan_tiles` chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.step.units import is_repeated_block
from tightfit.tiling.linear import LinearTile, TiledLinear, linear_features
from tightfit.utils.sizes import parse_size


def tile_bytes(in_f: int, out_f: int, in_splits: int, out_splits: int, dtype_bytes: int) -> int:
    """Parameter + gradient bytes of the largest tile of a grid (bias counted on every tile)."""
    rows, cols = math.ceil(out_f / out_splits), math.ceil(in_f / in_splits)
    return 2 * dtype_bytes * rows * (cols + 1)


MIN_TILE_ROWS = 128
"""Output-only grids are used while each tile keeps at least this many rows (or all of a smaller layer's rows).
Thinner tiles make thin matmuls (`g_o @ W_oi` has only `rows` as its inner dimension) whose arithmetic intensity
collapses. Measured on CPU (benchmarks/RESULTS.md): 256 tiles of a 2048x2048 layer took 2.2-2.5x less CPU time as a
16x16 grid than as 256 rows of 8."""


def grid_for_count(n_tiles: int, in_f: int, out_f: int) -> tuple[int, int]:
    """(in_splits, out_splits) for `n_tiles` tiles.

    The most output splits (whole dot products, no partial sums) while tiles keep `MIN_TILE_ROWS` rows; past that,
    the grid whose tiles are closest to square (largest min(rows, cols)), ties going to more output splits.
    Raises UsageError when no grid of exactly `n_tiles` fits a [out_f, in_f] weight.
    """
    if not isinstance(n_tiles, int) or n_tiles < 1:
        raise UsageError(f"tile count must be a positive integer, got {n_tiles!r}")
    grids = []  # (in_splits, out_splits), every factorisation of n_tiles that fits the weight
    for d in range(1, math.isqrt(n_tiles) + 1):
        if n_tiles % d == 0:
            for out_s in {d, n_tiles // d}:
                if out_s <= out_f and n_tiles // out_s <= in_f:
                    grids.append((n_tiles // out_s, out_s))
    if not grids:
        raise UsageError(f"cannot cut a {out_f}x{in_f} Linear into exactly {n_tiles} tiles; "
                         f"use at most {in_f * out_f} tiles, or a count with a divisor <= {out_f}")
    rows_only = max(grids, key=lambda g: g[1])
    if math.ceil(out_f / rows_only[1]) >= min(MIN_TILE_ROWS, out_f):
        return rows_only
    return max(grids, key=lambda g: (min(math.ceil(out_f / g[1]), math.ceil(in_f / g[0])), g[1]))


def plan_tiles(in_f: int, out_f: int, dtype_bytes: int, max_tile_bytes: int) -> tuple[int, int]:
    """(in_splits, out_splits) of the smallest grid whose tiles' params + grads fit in `max_tile_bytes`.

    Returns (1, 1) when the whole layer fits. Raises UsageError when even a single-element tile does not.
    """
    if tile_bytes(in_f, out_f, 1, 1, dtype_bytes) <= max_tile_bytes:
        return 1, 1
    if tile_bytes(1, 1, 1, 1, dtype_bytes) > max_tile_bytes:
        raise UsageError(f"max_tile_bytes={max_tile_bytes} cannot hold even one weight element and its gradient")
    n = max(2, math.ceil(tile_bytes(in_f, out_f, 1, 1, dtype_bytes) / max_tile_bytes))
    while True:  # terminates: n = in_f * out_f gives 1x1 tiles, which fit (checked above)
        try:
            in_s, out_s = grid_for_count(n, in_f, out_f)
        except UsageError:
            n += 1
            continue
        if tile_bytes(in_f, out_f, in_s, out_s, dtype_bytes) <= max_tile_bytes:
            return in_s, out_s
        n += 1


def _linear_bytes(linear: nn.Module) -> int:
    """Parameter + gradient bytes of a Linear (gradients share the parameters' dtype)."""
    return 2 * sum(p.numel() * p.element_size() for p in linear.parameters(recurse=False))


def tile_linears(
    model: nn.Module,
    max_tile_bytes: int | str | None = None,
    tiles: Mapping[str, int | tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Replace Linears of `model` by TiledLinears, in place; return {module path: number of tiles} of each one.

    "Linear" here means an `nn.Linear` or a Hugging Face `Conv1D` (GPT-2's layers: a Linear with its weight stored
    transposed, tiled with `transposed=True` so its checkpoint keys keep their [in, out] layout).
    - `tiles`: module path -> tile count (as in `Placement.tiled_linears`; grid from `grid_for_count`) or an explicit
      (in_splits, out_splits). Each path must name an `nn.Linear` or `Conv1D`, else UsageError. A count of 1 makes
      a one-tile TiledLinear: the layer moves as a unit of its own (`tile_units`), uncut.
    - `max_tile_bytes` (bytes or a size such as "256MiB"): every other `nn.Linear` whose parameters + gradient exceed
      it is tiled with `plan_tiles`. Linears whose weight is shared with another module (tied embeddings) are left
      alone here, since tiling would untie them; listing one in `tiles` is an error.

    Forward hooks registered on a replaced Linear are not carried over. The returned dict can be stored in
    `Placement.tiled_linears` and replays the same grids.
    """
    if max_tile_bytes is None and not tiles:
        raise UsageError("tile_linears: give max_tile_bytes (e.g. '256MiB') or tiles ({module path: tile count})")
    limit = None if max_tile_bytes is None else parse_size(max_tile_bytes, flag="max_tile_bytes")
    modules = dict(model.named_modules())
    tiles = dict(tiles or {})

    # Parameters used by more than one module: tiling such a Linear would give it its own copy and untie it.
    owners: dict[int, int] = {}
    for m in modules.values():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def tied(lin: nn.Module) -> bool:
        return any(owners[id(p)] > 1 for p in lin.parameters(recurse=False))

    grids: dict[str, tuple[int, int]] = {}
    for path, spec in tiles.items():
        lin = modules.get(path)
        feats = None if lin is None else linear_features(lin)
        if feats is None:
            found = "no such module" if lin is None else f"a {type(lin).__name__}"
            raise UsageError(f"tile_linears: {path!r} is {found}, not an nn.Linear or Conv1D")
        if tied(lin):
            raise UsageError(f"tile_linears: {path!r} shares its weight with another module (tied); cannot tile it")
        if isinstance(spec, tuple):
            in_s, out_s = spec
        else:
            in_s, out_s = grid_for_count(spec, *feats)
        grids[path] = (in_s, out_s)
    if limit is not None:
        for path, lin in modules.items():
            feats = linear_features(lin)
            if path in grids or feats is None or tied(lin) or _linear_bytes(lin) <= limit:
                continue
            grids[path] = plan_tiles(*feats, lin.weight.element_size(), limit)

    replaced = {}
    for path, (in_s, out_s) in grids.items():
        # A count of 1 (only ever asked for explicitly: `max_tile_bytes` picks layers that do not fit) still replaces
        # the layer, by a one-tile TiledLinear: `tile_units` then makes it a unit of its own, which is what the
        # planner counted when it split a too-large block by taking a Linear off whole (search.py, `_tile`).
        parent_path, _, name = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        tiled = TiledLinear.from_linear(modules[path], in_splits=in_s, out_splits=out_s)
        setattr(parent, name, tiled)  # the old Linear is dropped here, freeing its weight if nothing else holds it
        replaced[path] = in_s * out_s
    return replaced


def tile_paths(model: nn.Module) -> list[str]:
    """Module paths of every tile in `model`, in forward order: the units an offload engine should move one by one."""
    return [name for name, m in model.named_modules() if isinstance(m, LinearTile)]


def tile_units(model: nn.Module) -> list[str]:
    """Unit list for `tightfit.wrap(model, placement, units=tile_units(model))` that makes every tile its own unit.

    The engine's default detector picks the children of a ModuleList of same-class children (the blocks) and never
    looks inside a chosen unit, so tiles inside a block would move with their block. This list keeps the default
    units that hold no tile; inside a block (or any module) that holds tiles, each tile is a unit and so is each
    leaf module holding parameters (the untiled Linears, the norms) — the memory budget that forced tiling is
    too small for coarser pieces, and the rest of the block still streams instead of falling to the
    always-resident root unit. Only parameters held directly by a module
    that holds tiles fall to the root. Tiles outside any block (a tiled LM head) are found the same way.
    """
    units: list[str] = []

    def has_tile(m: nn.Module) -> bool:
        return any(isinstance(x, LinearTile) for x in m.modules())

    def has_params(m: nn.Module) -> bool:
        return next(m.parameters(), None) is not None

    def walk(module: nn.Module, prefix: str, inside_tiled: bool) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, LinearTile):
                units.append(path)
            elif has_tile(child):
                walk(child, path, inside_tiled=True)
            elif is_repeated_block(path, child, module) and has_params(child):
                units.append(path)
            elif inside_tiled and has_params(child) and not any(has_params(c) for c in child.children()):
                units.append(path)  # a leaf (Linear, norm) of a tiled block: streams on its own
            else:
                walk(child, path, inside_tiled)

    walk(model, "", inside_tiled=False)
    return units
