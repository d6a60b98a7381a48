"""Models nobody here wrote (issue 16): Hugging Face T5 and GPT-2 from tiny configs, each feature against PyTorch.

- T5 with checkpointed units: its decoder writes a key/value cache during forward, which the recomputation wrote
  again (torch's CheckpointError) until the checkpointed call ran without the cache, as Hugging Face's does.
- T5's feed-forward reads `self.wo.weight` (for its dtype) before calling `wo`: a tiled `wo` must answer.
- GPT-2's `Conv1D` layers (Linears with a transposed weight) are tiled, keep their checkpoint layout, and train.
- `min_unit_bytes` joins blocks of an explicit unit list too; `tightfit.units(model)` lists the unit names.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from offload_helpers import VOCAB, batch, hf_gpt2, max_rel_diff, one_torch_thread, train  # noqa: F401
from transformers import T5Config, T5ForConditionalGeneration
from transformers.pytorch_utils import Conv1D

import tightfit
from tightfit import Placement
from tightfit.tiling import TiledLinear, tile_linears, tile_units


def t5() -> nn.Module:
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


def wo_paths(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith("DenseReluDense.wo")]


def tiled_t5() -> nn.Module:
    m = t5()
    # Two output rows per wo: whole dot products, so the tiled layer computes what the Linear did.
    assert tile_linears(m, tiles={p: 2 for p in wo_paths(m)}) == {p: 2 for p in wo_paths(m)}
    return m


def test_t5_checkpointed_units_train_like_pytorch():
    blocks = [u for u in tightfit.units(t5()) if u != "root"]
    assert "decoder.block.1" in blocks
    ref = train(t5, steps=3)[0]
    got = train(t5, Placement.everywhere("host", checkpoint_units=blocks), steps=3)[0]
    assert got == ref, "recomputation in fp32 repeats the forward exactly"


def test_t5_feed_forward_reads_a_tiled_wo():
    torch.manual_seed(0)
    m = tiled_t5()
    wo = m.get_submodule(wo_paths(m)[0])
    assert isinstance(wo, TiledLinear)
    assert wo.weight.shape == (32, 64) and wo.weight.dtype == torch.float32  # what T5's forward asks of it
    ref = train(t5, steps=3)[0]
    tiled = train(tiled_t5, steps=3)[0]
    assert max_rel_diff(tiled, ref) < 1e-6
    # Offloaded with each tile its own unit: T5 reads wo.weight while the tiles are released (a meta stand-in
    # answers its dtype question); the math is the tiled model's, exactly.
    units = tile_units(tiled_t5())
    assert any(".wo.tiles." in u for u in units)
    got = train(tiled_t5, Placement.everywhere("host"), steps=3, wrap_kwargs={"units": units})[0]
    assert got == tiled


def test_tiled_weight_and_bias_are_the_full_tensors():
    torch.manual_seed(0)
    lin, conv = nn.Linear(12, 10), Conv1D(10, 12)
    for layer in (lin, conv):
        tiled = TiledLinear.from_linear(layer, in_splits=3, out_splits=2)
        assert torch.equal(tiled.weight, layer.weight) and tiled.weight.shape == layer.weight.shape
        assert torch.equal(tiled.bias, layer.bias)
        assert not tiled.weight.requires_grad and tiled.weight.grad_fn is None  # a copy, not a parameter
    no_bias = TiledLinear.from_linear(nn.Linear(12, 10, bias=False), out_splits=2)
    assert no_bias.bias is None
    # Tiles released by an offload engine (their storage resized to 0 bytes, shapes kept): shape and dtype only.
    released = TiledLinear.from_linear(conv, in_splits=2, out_splits=2)
    for p in released.parameters():
        p.untyped_storage().resize_(0)
    assert released.weight.device.type == "meta" and released.weight.shape == (12, 10)
    assert released.bias.device.type == "meta" and released.bias.shape == (10,)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_conv1d_tiles_compute_what_the_conv1d_did():
    torch.manual_seed(0)
    conv = Conv1D(24, 16)  # nf=24 out, nx=16 in: weight [16, 24]
    x = torch.randn(2, 5, 16)
    g = torch.randn(2, 5, 24)
    for in_s, out_s in ((1, 3), (2, 3)):
        tiled = TiledLinear.from_linear(conv, in_splits=in_s, out_splits=out_s)
        assert tiled.transposed and tiled.tile(0, 0).weight.shape == (16 // in_s, 8)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = conv(x1), tiled(x2)
        y_ref.backward(g)
        y.backward(g)
        # As for nn.Linear (test_tiling_linear.py): the BLAS kernel blocks a narrower matmul differently.
        assert rel(y, y_ref) < 1e-6 and rel(x2.grad, x1.grad) < 1e-6
        gw = torch.cat([torch.cat([tiled.tile(o, i).weight.grad for i in range(in_s)], 0) for o in range(out_s)], 1)
        assert rel(gw, conv.weight.grad) < 1e-6
        conv.zero_grad()
        # Checkpoint layout: the Conv1D's keys and [in, out] shapes, both ways.
        sd = tiled.state_dict()
        assert list(sd) == ["weight", "bias"] and sd["weight"].shape == (16, 24)
        assert torch.equal(sd["weight"], conv.weight) and torch.equal(sd["bias"], conv.bias)
        fresh = TiledLinear(16, 24, in_s, out_s, transposed=True)
        fresh.load_state_dict(conv.state_dict())
        assert torch.equal(fresh.weight, conv.weight)


def test_gpt2_conv1d_layers_are_tiled_and_train():
    torch.manual_seed(0)
    ref_model = hf_gpt2()
    model = hf_gpt2()
    model.load_state_dict(ref_model.state_dict())
    # Params + grads in fp32: c_proj 8.25 KiB up to c_fc 33 KiB; an 8 KiB limit tiles every Conv1D (the head is tied).
    tiled = tile_linears(model, max_tile_bytes=8 * 1024)
    assert set(tiled) == {f"transformer.h.{i}.{m}" for i in range(2)
                          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    # Saved like the untiled model: HF's save_pretrained/from_pretrained see the same keys, shapes and values.
    sd, ref_sd = model.state_dict(), ref_model.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    x, _ = batch(0)
    assert rel(model(input_ids=x).logits, ref_model(input_ids=x).logits) < 1e-6

    def build():
        m = hf_gpt2()
        tile_linears(m, max_tile_bytes=8 * 1024)
        return m

    plain = train(build, steps=3)[0]
    assert max_rel_diff(plain, train(hf_gpt2, steps=3)[0]) < 1e-6
    got = train(build, Placement.everywhere("host"), steps=3, wrap_kwargs={"units": tile_units(build())})[0]
    assert got == plain


def test_units_lists_the_names_a_placement_takes():
    with torch.device("meta"):
        meta = hf_gpt2()
    assert tightfit.units(meta) == ["root", "transformer.h.0", "transformer.h.1"]
    assert tightfit.units(meta, min_unit_bytes=10**9) == ["root", "transformer.h.0-1"]
    # A name from the list places that unit.
    placement = Placement.everywhere("host").with_units(
        **{"transformer.h.1": tightfit.UnitPlacement.all_on("device")})
    ref = train(hf_gpt2, steps=2)[0]
    assert train(hf_gpt2, placement, steps=2)[0] == ref


def test_min_unit_bytes_groups_an_explicit_unit_list():
    with torch.device("meta"):
        meta = hf_gpt2()
    explicit = ["transformer.h.*", "transformer.wpe"]
    assert tightfit.units(meta, explicit) == ["root", "transformer.wpe", "transformer.h.0", "transformer.h.1"]
    grouped = tightfit.units(meta, explicit, min_unit_bytes=10**9)
    assert grouped == ["root", "transformer.wpe", "transformer.h.0-1"]  # only list siblings are joined
    ref = train(hf_gpt2, steps=2)[0]
    got = train(hf_gpt2, Placement.everywhere("host", min_unit_bytes=10**9), steps=2,
                wrap_kwargs={"units": explicit})
    assert got[0] == ref
    from tightfit.offload import engine_of

    assert sorted(engine_of(got[1]).units) == sorted(grouped)


def test_the_planner_tiles_gpt2_conv1d_layers_when_a_block_does_not_fit():
    from transformers import GPT2Config, GPT2LMHeadModel

    from tightfit.config import Config
    from tightfit.planner import HardwareProfile, make_plan
    from tightfit.planner.hardware import GiB

    # Blocks of 12.6M parameters (50 MiB fp32; c_fc and c_proj 16 MiB each) cannot stream through 60 MiB.
    with torch.device("meta"):
        m = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=1024, n_layer=2, n_head=8))
    c = Config()
    c.memory.gpu_mem, c.memory.cpu_mem, c.memory.checkpointing = "60MiB", "64GiB", "on"
    c.train.micro_batch, c.train.seq_len = 1, 16
    plan = make_plan(m, c, HardwareProfile.synthetic(host_available=200 * GiB, host_total=256 * GiB))
    tiled = plan.placement.tiled_linears
    assert tiled and all(p.startswith("transformer.h.") for p in tiled), tiled
    assert tile_linears(m, tiles=tiled) == tiled  # what the trainer applies before wrapping
    assert all(isinstance(m.get_submodule(p), TiledLinear) and m.get_submodule(p).transposed for p in tiled)
