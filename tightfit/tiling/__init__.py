"""Memory-centric tiling: layers too large for one offload unit, cut into tiles that are computed one at a time.

- `TiledLinear` (linear.py): an nn.Linear (or a Hugging Face Conv1D) stored as a grid of `LinearTile`s,
  checkpoint-compatible with the layer it replaces.
- `tile_linears`, `plan_tiles`, `tile_paths`, `tile_units` (transform.py): the in-place transform the planner applies to
  oversized Linears, and the arithmetic that turns a byte budget into a grid.
- `tiled_cross_entropy`, `TiledLMHeadLoss` (loss.py): LM head + cross-entropy without the [tokens x vocab] logits.

See docs/TILING.md for the design and its costs.
"""

from tightfit.tiling.linear import LinearTile, TiledLinear, linear_features, split_sizes
from tightfit.tiling.loss import TiledLMHeadLoss, tiled_cross_entropy
from tightfit.tiling.transform import grid_for_count, plan_tiles, tile_bytes, tile_linears, tile_paths, tile_units

__all__ = [
    "LinearTile",
    "TiledLMHeadLoss",
    "TiledLinear",
    "grid_for_count",
    "linear_features",
    "plan_tiles",
    "split_sizes",
    "tile_bytes",
    "tile_linears",
    "tile_paths",
    "tile_units",
    "tiled_cross_entropy",
]
