"""A wrapped model stays an nn.Module (issue 16): state dicts through the tiers, parameter reads, conversions, and
foreign optimizers / clippers refused with one line.

The reference is plain PyTorch on the same seed and data: after the same training steps, `state_dict()` of the
wrapped model equals the plain model's (fp32, bitwise: the offloaded AdamW is torch's fused one), for every tier.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from offload_helpers import (  # noqa: F401
    batch,
    hf_gpt2,
    hf_llama,
    loss_of,
    one_torch_thread,
    tiny_gpt,
    train,
)

import tightfit
from tightfit.errors import UsageError
from tightfit.offload import Placement
from tightfit.offload.model_state.module_state import iter_state_dict
from tightfit.offload.model_state.state_io import export_state
from tightfit.optim import AdamW

TIERS = ["device", "host", "nvme"]


def placement(tier: str, tmp_path) -> Placement:
    return Placement.everywhere(tier, nvme_dir=str(tmp_path / "swap") if tier == "nvme" else None)


def wrapped(build, tier, tmp_path, seed=0, **kw):
    torch.manual_seed(seed)
    model = build()
    return tightfit.wrap(model, placement(tier, tmp_path), device="cpu", **kw)


def plain(build, seed=0):
    torch.manual_seed(seed)
    return build()


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


# ---- state_dict ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
def test_state_dict_equals_plain_pytorch_after_training(tier, tmp_path):
    _, ref, _ = train(tiny_gpt, None, steps=3)
    _, model, _ = train(tiny_gpt, placement(tier, tmp_path), steps=3)
    sd = model.state_dict()
    assert_same_state(sd, ref.state_dict())
    assert all(v.untyped_storage().nbytes() == v.nbytes for v in sd.values())  # own storage each: no false sharing
    streamed = dict(iter_state_dict(model))  # unit by unit: the same keys and values, in unit order
    assert_same_state({k: streamed[k] for k in sd}, ref.state_dict())
    assert len(streamed) == len(sd)


def test_state_dict_is_the_fp32_master_under_bf16_compute(tmp_path):
    model = wrapped(tiny_gpt, "nvme", tmp_path, compute_dtype=torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0)
    loss_of(model, x, y).backward()
    opt.step()
    sd = model.state_dict()
    masters = {k.removeprefix("model."): v for k, v in export_state(model)}
    assert next(model.parameters()).dtype == torch.bfloat16
    for name, value in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], value), name


def test_tied_names_share_one_tensor(tmp_path):
    model = wrapped(hf_gpt2, "host", tmp_path)
    sd = model.state_dict()
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    assert list(sd) == list(plain(hf_gpt2).state_dict())


def test_torch_save_of_state_dict_loads_into_a_plain_model(tmp_path):
    _, model, _ = train(tiny_gpt, placement("nvme", tmp_path), steps=2)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh = plain(tiny_gpt, seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    x, y = batch(7)
    with torch.no_grad():
        assert torch.equal(loss_of(fresh, x, y), loss_of(model, x, y))


# ---- load_state_dict -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_writes_master_and_compute_copies(tier, dtype, tmp_path):
    source = plain(tiny_gpt, seed=5)
    model = wrapped(tiny_gpt, tier, tmp_path, compute_dtype=dtype)
    assert model.load_state_dict(source.state_dict()) is not None
    assert_same_state(model.state_dict(), source.state_dict())  # the fp32 master, exactly
    x, y = batch(3)
    with torch.no_grad():
        want = loss_of(source.to(dtype), x, y)
        assert torch.equal(loss_of(model, x, y), want)


def test_load_then_train_matches_plain_pytorch(tmp_path):
    source = plain(tiny_gpt, seed=5).state_dict()
    ref = plain(tiny_gpt)
    ref.load_state_dict(source)
    model = wrapped(tiny_gpt, "nvme", tmp_path)
    model.load_state_dict(source)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        for m, o in ((ref, opt_ref), (model, opt)):
            x, y = batch(step)
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_same_state(model.state_dict(), ref.state_dict())


def test_load_state_dict_strict_semantics_are_torchs(tmp_path):
    ref = plain(tiny_gpt)
    model = wrapped(tiny_gpt, "nvme", tmp_path)
    good = plain(tiny_gpt, seed=3).state_dict()
    before = model.state_dict()
    missing = {k: v for k, v in good.items() if k != "head.weight"}
    extra = {**good, "nonsense.weight": torch.zeros(2)}
    for sd in (missing, extra):
        with pytest.raises(RuntimeError) as want:
            ref.load_state_dict(sd)
        with pytest.raises(RuntimeError) as got:
            model.load_state_dict(sd)
        assert str(got.value) == str(want.value)
        assert model.load_state_dict(sd, strict=False) == ref.load_state_dict(sd, strict=False)
    bad = {**good, "blocks.0.attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match="size mismatch for blocks.0.attn.q_proj.weight"):
        model.load_state_dict(bad)
    # A partial load writes what it is given and keeps the rest, as torch's does.
    model.load_state_dict(before)
    model.load_state_dict({"head.weight": good["head.weight"]}, strict=False)
    now = model.state_dict()
    assert torch.equal(now["head.weight"], good["head.weight"])
    assert torch.equal(now["blocks.1.mlp.up.weight"], before["blocks.1.mlp.up.weight"])


def test_load_state_dict_of_a_submodule(tmp_path):
    model = wrapped(tiny_gpt, "host", tmp_path)
    source = plain(tiny_gpt, seed=4)
    model.blocks[1].load_state_dict(source.blocks[1].state_dict())
    model.blocks[0].attn.load_state_dict(source.blocks[0].attn.state_dict())
    sd = model.state_dict()
    for k, v in source.state_dict().items():
        if k.startswith(("blocks.1.", "blocks.0.attn.")):
            assert torch.equal(sd[k], v), k


def test_load_state_dict_assign_is_refused(tmp_path):
    model = wrapped(tiny_gpt, "host", tmp_path)
    with pytest.raises(UsageError, match="assign=True"):
        model.load_state_dict(plain(tiny_gpt).state_dict(), assign=True)


# ---- Hugging Face ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_save_pretrained_from_pretrained_round_trip(build, tier, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tightfit.models.hf_save import save_hf_model

    _, model, _ = train(build, placement(tier, tmp_path), steps=2)
    x, _ = batch(9)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    model.save_pretrained(tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    save_hf_model(model, tmp_path / "streamed")  # the streaming path, a unit at a time
    streamed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").eval()
    again = tightfit.wrap(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                          placement(tier, tmp_path / "again"), device="cpu").eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, logits)
        assert torch.equal(streamed(input_ids=x).logits, logits)
        assert torch.equal(again(input_ids=x).logits, logits)


# ---- reading parameters, conversions -------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_reading_a_parameter_outside_forward_gives_its_value(tier, tmp_path):
    _, ref, _ = train(tiny_gpt, None, steps=2)
    _, model, _ = train(tiny_gpt, placement(tier, tmp_path), steps=2)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        with torch.no_grad():
            assert torch.equal(p.sum(), want[name].sum()), name
        assert torch.equal(p.detach(), want[name].detach())
        assert torch.equal(p.data, want[name].data)
    p = model.get_parameter("blocks.0.mlp.up.weight")
    assert repr(p) == repr(want["blocks.0.mlp.up.weight"]) and str(p) == str(want["blocks.0.mlp.up.weight"])
    with pytest.raises(UsageError, match="outside the model's forward with autograd recording"):
        p.sum()
    with pytest.raises(UsageError, match="load_state_dict"), torch.no_grad():
        p.zero_()
    with pytest.raises(UsageError, match="load_state_dict"), torch.no_grad():
        p.copy_(torch.zeros_like(p))
    assert p.shape == want["blocks.0.mlp.up.weight"].shape and p.numel() > 0 and p.requires_grad


def test_a_materialised_parameter_is_read_through_a_copy(tmp_path):
    """Between forward and backward the root unit is in memory, until its release: p.data must not alias it."""
    model = wrapped(tiny_gpt, "host", tmp_path)
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = batch(0)
    loss = loss_of(model, x, y)
    p = model.get_parameter("head.weight")
    kept = p.data
    with pytest.raises(UsageError, match="autograd recording"):
        (p ** 2).sum()  # an L2 term outside forward would get no gradient
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert kept.untyped_storage().nbytes() == kept.nbytes and torch.isfinite(kept).all()
    with torch.no_grad():
        assert not torch.equal(p.detach(), kept)  # the step changed the parameter, not the copy


def test_dtype_and_device_conversions(tmp_path):
    model = wrapped(tiny_gpt, "nvme", tmp_path)
    for call in (model.half, model.double, model.bfloat16, lambda: model.to(torch.float16),
                 lambda: model.to("meta"), model.cuda):
        with pytest.raises(UsageError, match=r"compute_dtype=\.\.\., device=\.\.\."):
            call()
    assert model.float() is model and model.to("cpu") is model and model.to(torch.float32) is model
    x, y = batch(0)
    loss_of(model, x, y).backward()  # still trains after the refusals
    bf16 = wrapped(tiny_gpt, "host", tmp_path / "b", compute_dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="stay bfloat16"):
        bf16.float()
    assert bf16.bfloat16() is bf16


# ---- foreign optimizers and clippers -------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.SGD(ps, lr=0.1)])
def test_foreign_optimizer_is_refused_when_built(make, tmp_path):
    model = wrapped(tiny_gpt, "nvme", tmp_path)
    with pytest.raises(UsageError, match="tightfit.optim.AdamW"):
        make(model.parameters())
    AdamW(model.parameters())  # tightfit's own is built as before


def test_foreign_optimizer_built_before_wrap_is_refused_at_its_step(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    tightfit.wrap(model, placement("host", tmp_path), device="cpu")
    x, y = batch(0)
    loss_of(model, x, y).backward()
    with pytest.raises(UsageError, match="tightfit.optim.AdamW"):
        opt.step()


def test_torch_clip_grad_norm_is_refused_and_zero_grad_drops_gradients(tmp_path):
    model = wrapped(tiny_gpt, "nvme", tmp_path)
    opt = AdamW(model.parameters(), lr=1e-2)
    before = model.state_dict()
    x, y = batch(0)
    loss_of(model, x, y).backward()
    with pytest.raises(UsageError, match="opt.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(UsageError, match="opt.clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
    assert float(opt.clip_grad_norm_(1.0)) > 0  # the engine's gradients are intact
    model.zero_grad()  # as with plain PyTorch: the gradients are gone, the step changes nothing, and says so
    assert all(p.grad is None for p in model.parameters())
    with pytest.warns(UserWarning, match="left no gradient"):
        opt.step()
    assert_same_state(model.state_dict(), before)
    loss_of(model, x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # gradients reached it: no warning
    assert not torch.equal(model.state_dict()["head.weight"], before["head.weight"])
    loss_of(model, x, y).backward()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # opt.zero_grad() is the user's own decision, and the warning was given once already


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2-tied", "llama"])
def test_save_pretrained_streams_a_deferred_state_dict(build, tmp_path):
    """save_pretrained over `deferred_state_dict` reads each unit's master when its shard is written, not before."""
    transformers = pytest.importorskip("transformers")
    from tightfit.offload import engine_of
    from tightfit.offload.model_state.module_state import deferred_state_dict

    _, model, _ = train(build, placement("nvme", tmp_path), steps=2)
    engine = engine_of(model)
    reads = []
    read_master = engine.read_master
    engine.read_master = lambda unit: reads.append(unit.name) or read_master(unit)
    sd = deferred_state_dict(model)
    assert list(sd) == list(plain(build).state_dict()) and reads == []  # keys only, nothing read yet
    model.save_pretrained(tmp_path / "hf", state_dict=sd, max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    assert sorted(set(reads)) == sorted(engine.units) and len(reads) <= len(engine.units) + 1  # the root: twice
    x, _ = batch(4)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, model(input_ids=x).logits)


def test_close_gives_plain_parameters_back(tmp_path):
    class MyParameter(torch.nn.Parameter):
        pass

    torch.manual_seed(0)
    model = tiny_gpt()
    model.head.weight = MyParameter(model.head.weight.detach().clone())
    tightfit.wrap(model, placement("host", tmp_path), device="cpu")
    assert isinstance(model.head.weight, MyParameter)  # the model's own class still answers isinstance
    with torch.no_grad():
        assert torch.isfinite(model.head.weight.sum())
    from tightfit.offload import engine_of

    engine_of(model).close()
    assert type(model.head.weight) is MyParameter
    assert all(type(p) is torch.nn.Parameter for n, p in model.named_parameters() if n != "head.weight")


def test_a_state_dict_cut_short_leaves_reads_guarded(tmp_path):
    """An exception inside state_dict() (here a user's hook) must not leave the parameters unguarded."""
    model = wrapped(tiny_gpt, "host", tmp_path)

    def boom(module, state_dict, prefix, local_metadata):
        raise RuntimeError("hook failed")

    handle = model.blocks[0].register_state_dict_post_hook(boom)
    with pytest.raises(RuntimeError, match="hook failed"):
        model.state_dict()
    handle.remove()
    x, y = batch(0)
    with torch.no_grad():
        loss_of(model, x, y)  # the next forward takes the bypass back
    p = model.get_parameter("blocks.1.mlp.up.weight")
    with pytest.raises(UsageError, match="autograd recording"):
        p.sum()
    assert list(model.state_dict()) == list(plain(tiny_gpt).state_dict())
