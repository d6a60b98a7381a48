"""TiledLinear against nn.Linear: forward, gradients, checkpoints, autocast; and the tile_linears transform."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.tiling import (
    LinearTile,
    TiledLinear,
    grid_for_count,
    plan_tiles,
    split_sizes,
    tile_bytes,
    tile_linears,
    tile_paths,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_f,out_f,in_s,out_s", [
    (32, 48, 1, 1), (32, 48, 1, 4), (32, 48, 4, 1), (32, 48, 2, 3),
    (37, 53, 3, 5),  # uneven slices on both sides
    (64, 7, 5, 7),   # one output feature per row
])
def test_tiled_matches_linear(in_f, out_f, in_s, out_s, bias):
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear.from_linear(ref, in_splits=in_s, out_splits=out_s)
    assert len(tiled.tiles) == in_s * out_s

    x = torch.randn(3, 5, in_f)  # [B, T, in]: leading dims pass through
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 5, out_f)
    y_ref, y = ref(x1), tiled(x2)
    assert y.shape == y_ref.shape
    assert rel(y, y_ref) < 1e-6
    y_ref.backward(g)
    y.backward(g)
    assert rel(x2.grad, x1.grad) < 1e-6
    # Weight/bias gradients of the tiles, gathered, equal the Linear's.
    gw = torch.cat([torch.cat([tiled.tile(o, i).weight.grad for i in range(in_s)], 1) for o in range(out_s)], 0)
    assert rel(gw, ref.weight.grad) < 1e-6
    if bias:
        gb = torch.cat([tiled.tile(o, 0).bias.grad for o in range(out_s)])
        assert rel(gb, ref.bias.grad) < 1e-6
        assert all(tiled.tile(o, i).bias is None for o in range(out_s) for i in range(1, in_s))


def test_state_dict_round_trip_both_ways():
    torch.manual_seed(0)
    ref = nn.Linear(13, 22)
    tiled = TiledLinear(13, 22, in_splits=3, out_splits=4)
    # Linear -> TiledLinear
    tiled.load_state_dict(ref.state_dict())
    assert torch.equal(tiled.gathered_weight(), ref.weight) and torch.equal(tiled.gathered_bias(), ref.bias)
    # TiledLinear -> Linear: same keys, same values
    sd = tiled.state_dict()
    assert list(sd) == ["weight", "bias"]
    other = nn.Linear(13, 22)
    other.load_state_dict(sd)
    assert torch.equal(other.weight, ref.weight) and torch.equal(other.bias, ref.bias)
    # Inside a model: prefixes, key order and strict loading
    model = nn.Sequential(nn.Linear(13, 13), ref, nn.ReLU())
    sd_ref = model.state_dict()
    tile_linears(model, tiles={"1": 12})
    assert isinstance(model[1], TiledLinear)
    sd_tiled = model.state_dict()
    assert list(sd_tiled) == list(sd_ref)
    assert all(torch.equal(sd_tiled[k], sd_ref[k]) for k in sd_ref)
    model.load_state_dict(sd_ref, strict=True)
    model.load_state_dict(sd_tiled, assign=True)
    assert model[1].tile(0, 0).weight.is_contiguous()


def test_to_linear_and_native_keys():
    torch.manual_seed(0)
    tiled = TiledLinear(10, 9, in_splits=2, out_splits=3, bias=False)
    lin = tiled.to_linear()
    x = torch.randn(4, 10)
    assert rel(lin(x), tiled(x)) < 1e-6 and lin.bias is None
    native = {f"tiles.{k}.weight": t.weight.detach().clone() for k, t in enumerate(tiled.tiles)}
    fresh = TiledLinear(10, 9, in_splits=2, out_splits=3, bias=False)
    fresh.load_state_dict(native)
    assert torch.equal(fresh.gathered_weight(), tiled.gathered_weight())


def test_shape_mismatch_and_bad_splits():
    tiled = TiledLinear(8, 8, 2, 2)
    with pytest.raises(RuntimeError, match="size mismatch"):
        tiled.load_state_dict(nn.Linear(8, 9).state_dict())
    with pytest.raises(UsageError):
        TiledLinear(8, 8, in_splits=9)
    with pytest.raises(UsageError):
        TiledLinear(8, 8, out_splits=0)
    with pytest.raises(UsageError):
        tiled(torch.randn(2, 7))


def test_init_matches_linear_distribution():
    torch.manual_seed(0)
    tiled = TiledLinear(400, 300, in_splits=4, out_splits=3)
    bound = 1 / 400**0.5
    w = tiled.gathered_weight()
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound


def test_autocast_bf16_cpu():
    torch.manual_seed(0)
    ref = nn.Linear(64, 96)
    tiled = TiledLinear.from_linear(ref, in_splits=2, out_splits=3)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = tiled(x), ref(x)
    assert y.dtype == torch.bfloat16
    assert rel(y.float(), y_ref.float()) < 2e-2
    y.float().sum().backward()
    assert x.grad is not None and tiled.tile(2, 1).weight.grad.dtype == torch.float32


def test_split_and_grid_helpers():
    assert split_sizes(10, 3) == [4, 3, 3] and sum(split_sizes(53, 5)) == 53
    assert grid_for_count(6, in_f=1000, out_f=1000) == (1, 6)  # output splits first
    assert grid_for_count(6, in_f=100, out_f=100) == (2, 3)  # 17-row tiles would be thin: squarer grid
    assert grid_for_count(16, in_f=2048, out_f=2048) == (1, 16)  # 128-row tiles: still output-only
    assert grid_for_count(64, in_f=2048, out_f=2048) == (8, 8)  # 32-row tiles would be thin: square grid
    assert grid_for_count(12, in_f=100, out_f=4) == (12, 1)  # 4 rows at most: tiles [4, 9], not [1, 34]
    with pytest.raises(UsageError):
        grid_for_count(7, in_f=3, out_f=4)  # prime above out_f and in_f
    # Whole layer fits -> no tiles; otherwise every tile fits and the count replays the same grid.
    assert plan_tiles(16, 16, 4, 10**9) == (1, 1)
    for in_f, out_f, budget in [(1024, 4096, 4 << 20), (4096, 256, 1 << 20), (300, 7, 2000), (50, 3, 300)]:
        in_s, out_s = plan_tiles(in_f, out_f, 4, budget)
        assert tile_bytes(in_f, out_f, in_s, out_s, 4) <= budget
        assert grid_for_count(in_s * out_s, in_f, out_f) == (in_s, out_s)
    with pytest.raises(UsageError):
        plan_tiles(4, 4, 4, 8)


def test_tile_linears_on_gpt_keeps_outputs():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    idx = torch.randint(0, 96, (2, 16))
    tgt = torch.randint(0, 96, (2, 16))
    loss_ref = model(idx, tgt)
    loss_ref.backward()
    grads_ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    sd_ref = model.state_dict()
    model.zero_grad(set_to_none=True)

    # up/down are 32x128 (+bias): 2 * 4 * (4096 + 128) B = 33 KiB of params + grads; head is 96x32.
    replaced = tile_linears(model, max_tile_bytes="12KiB", tiles={"head": 4})
    assert replaced["head"] == 4
    assert {"blocks.0.mlp.up", "blocks.1.mlp.down"} <= set(replaced)
    assert "blocks.0.attn.q_proj" not in replaced  # 32x32 fits
    for path, n in replaced.items():
        mod = model.get_submodule(path)
        assert isinstance(mod, TiledLinear) and len(mod.tiles) == n
        if path != "head":
            assert tile_bytes(mod.in_features, mod.out_features, mod.in_splits, mod.out_splits, 4) <= 12 * 1024
    assert all(isinstance(model.get_submodule(p), LinearTile) for p in tile_paths(model))

    loss = model(idx, tgt)
    assert abs(loss.item() - loss_ref.item()) < 1e-6
    loss.backward()
    # Checkpoint keys and values unchanged, and the gradients (gathered from the tiles) equal the untiled ones.
    sd = model.state_dict()
    assert list(sd) == list(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    for path in replaced:
        mod = model.get_submodule(path)
        gw = torch.cat([torch.cat([mod.tile(o, i).weight.grad for i in range(mod.in_splits)], 1)
                        for o in range(mod.out_splits)], 0)
        assert rel(gw, grads_ref[path + ".weight"]) < 1e-5


def test_tile_linears_errors_and_tied_weights():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    assert tile_linears(model, max_tile_bytes=64) == {}  # tied Linear left alone by the budget rule
    with pytest.raises(UsageError, match="tied"):
        tile_linears(model, tiles={"1": 2})
    with pytest.raises(UsageError, match="not an nn.Linear"):
        tile_linears(model, tiles={"0": 2})
    with pytest.raises(UsageError, match="no such module"):
        tile_linears(model, tiles={"nope": 2})
    with pytest.raises(UsageError):
        tile_linears(model)
    with pytest.raises(UsageError, match="max_tile_bytes"):
        tile_linears(model, max_tile_bytes="lots")


def test_engine_style_hooks_fire_per_tile_in_order():
    """An offload engine brackets each tile with forward and full backward hooks; both must fire once per tile."""
    tiled = TiledLinear(8, 6, in_splits=2, out_splits=3)
    fwd, bwd = [], []
    for k, m in enumerate(tiled.tiles):
        m.register_forward_pre_hook(lambda mod, args, k=k: fwd.append(k))
        m.register_full_backward_pre_hook(lambda mod, g, k=k: bwd.append(k))
    tiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert fwd == list(range(6))
    assert sorted(bwd) == list(range(6))
