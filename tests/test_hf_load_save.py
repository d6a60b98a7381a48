"""Hugging Face checkpoints: stream-load, train, save, and reload with transformers itself.

The reference for every comparison is transformers: `from_pretrained` of the folder tightfit wrote must give the
logits tightfit's model gives (fp32, <= 1e-5 relative), for tied and untied embeddings, sharded and single-file
folders, in both directions (folders written by `save_pretrained`, folders written by tightfit).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tightfit.models.build import model_loss  # noqa: E402
from tightfit.models.hf_load import HFCheckpoint, build_meta_model, load_hf_model, stream_into  # noqa: E402
from tightfit.models.hf_save import save_hf_model  # noqa: E402

VOCAB = 96


def gpt2_config():
    # Dropout off: training must be deterministic for the plain-vs-tightfit comparison.
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=0, eos_token_id=0)


def llama_config(tied: bool):
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)


CONFIGS = {"gpt2-tied": gpt2_config, "llama-tied": lambda: llama_config(True),
           "llama-untied": lambda: llama_config(False)}


def hf_folder(tmp_path, name: str, shard: str | None) -> tuple[object, str]:
    """A reference model from transformers, saved by transformers (sharded when `shard` is a size)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    folder = tmp_path / "hf_in"
    ref.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return ref.eval(), str(folder)


def assert_close_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= 1e-5, rel


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, VOCAB, (2, 17), generator=g)
    return tok[:, :-1], tok[:, 1:]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shard_in,shard_out", [(None, "1GB"), ("16KB", "20KB")])
def test_load_train_save_reload(tmp_path, name, shard_in, shard_out):
    ref, folder = hf_folder(tmp_path, name, shard_in)
    assert (tmp_path / "hf_in" / "model.safetensors.index.json").exists() == (shard_in is not None)
    model = load_hf_model(folder)
    x, _ = batch(0)
    with torch.no_grad():
        assert_close_logits(model.eval()(x).logits, ref(x).logits)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == ref.config.tie_word_embeddings

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step)
        loss = model_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = tmp_path / "out"
    save_hf_model(model, out, max_shard_size=shard_out)
    assert (out / "model.safetensors.index.json").exists() == (shard_out == "20KB")
    if shard_out == "20KB":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" in index["weight_map"] or ref.config.tie_word_embeddings

    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x, _ = batch(99)
    with torch.no_grad():
        assert_close_logits(model.eval()(x).logits, back(x).logits)
        # Training moved the weights: the reloaded model is the trained one, not the original.
        assert (back(x).logits - ref(x).logits).abs().max() > 1e-3
    assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings


def test_model_loss_matches_hf_shifted_labels(tmp_path):
    """model_loss takes pre-shifted (x, y); transformers shifts `labels` itself: both give the same number."""
    ref, folder = hf_folder(tmp_path, "llama-untied", None)
    model = load_hf_model(folder).eval()
    tok = batch(3)[0]
    with torch.no_grad():
        ours = model_loss(model, tok[:, :-1], tok[:, 1:])
        theirs = ref(input_ids=tok, labels=tok).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_streaming_is_one_unit_at_a_time(tmp_path):
    """While unit k is handed over, the units after it are still on meta: the model is never held twice."""
    _, folder = hf_folder(tmp_path, "llama-tied", "16KB")
    ckpt = HFCheckpoint.open(folder)
    model = build_meta_model(ckpt.config)
    seen = []

    def on_unit(unit, names):
        materialised = sum(not p.is_meta for p in model.parameters())
        seen.append((unit, len(names), materialised))
        assert all(not model.get_parameter(n).is_meta for n in names)

    stream_into(model, ckpt, on_unit=on_unit)
    assert [u for u, _, _ in seen] == ["root", "model.layers.0", "model.layers.1"]
    counts = [m for _, _, m in seen]
    assert counts == sorted(counts) and counts[0] < counts[-1] == len(list(model.parameters()))


def test_bf16_checkpoint_loads_into_fp32_and_saves_back_as_bf16(tmp_path):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(llama_config(False)).to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "bf16")
    model = load_hf_model(tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight.float(), rtol=0, atol=0)
    save_hf_model(model, tmp_path / "out", dtype=torch.bfloat16)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.lm_head.weight, ref.lm_head.weight, rtol=0, atol=0)


def test_base_model_checkpoint_loads_into_causal_lm(tmp_path):
    """The original GPT-2 release stores `h.0...` without the `transformer.` prefix; accepted, as transformers does."""
    torch.manual_seed(0)
    base = transformers.GPT2Model(gpt2_config()).eval()
    base.save_pretrained(tmp_path / "base")
    model = load_hf_model(tmp_path / "base").eval()
    x, _ = batch(1)
    with torch.no_grad():
        assert_close_logits(model.transformer(x).last_hidden_state, base(x).last_hidden_state)


def test_save_keeps_other_files_and_replaces_stale_shards(tmp_path):
    ref, folder = hf_folder(tmp_path, "gpt2-tied", None)
    model = load_hf_model(folder)
    out = tmp_path / "out"
    save_hf_model(model, out, max_shard_size="20KB")
    (out / "tokenizer.json").write_text("{}")
    save_hf_model(model, out)  # one shard now: the old shards and index must go, the tokenizer must stay
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folders left


def test_config_only_folder_gives_random_init(tmp_path):
    llama_config(True).save_pretrained(tmp_path / "cfg")
    torch.manual_seed(0)
    model = load_hf_model(tmp_path / "cfg")
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # the model's own init (initializer_range 0.02), not torch.empty garbage
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    x, _ = batch(0)
    assert torch.isfinite(model(x).logits).all()


# ---- the same, through the offload engine: weights streamed into NVMe tiers, trained with tightfit's AdamW ----

@pytest.mark.parametrize("name,shard_in", [("gpt2-tied", None), ("llama-tied", "16KB"), ("llama-untied", "16KB")])
def test_wrapped_load_train_save_reload(tmp_path, name, shard_in):
    import tightfit
    import tightfit.optim
    from tightfit.models.hf_wrap import load_hf_wrapped

    ref, folder = hf_folder(tmp_path, name, shard_in)
    placement = tightfit.Placement.everywhere("nvme", nvme_dir=str(tmp_path / "swap"))
    model = load_hf_wrapped(folder, placement)
    x, _ = batch(0)
    with torch.no_grad():
        assert_close_logits(model.eval()(x).logits, ref(x).logits)

    plain = load_hf_model(folder)  # the same 3 steps in plain PyTorch, the numerics reference
    opts = [tightfit.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)]
    for m, opt in zip([model.train(), plain.train()], opts):
        for step in range(3):
            x, y = batch(step)
            model_loss(m, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    save_hf_model(model, tmp_path / "out", max_shard_size="20KB")  # streamed from the NVMe tier
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x, _ = batch(99)
    with torch.no_grad():
        ours = model.eval()(x).logits
        assert_close_logits(ours, back(x).logits)
        torch.testing.assert_close(ours, plain.eval()(x).logits, rtol=1e-4, atol=1e-5)
    assert back.config.tie_word_embeddings == ref.config.tie_word_embeddings


def test_wrapped_frozen_parameters_have_no_grad_or_optimizer_state(tmp_path):
    import tightfit
    import tightfit.optim
    from tightfit.models.hf_wrap import load_hf_wrapped
    from tightfit.offload.step.engine import engine_of

    ref, folder = hf_folder(tmp_path, "llama-untied", None)
    placement = tightfit.Placement.everywhere("nvme", nvme_dir=str(tmp_path / "swap"))
    model = load_hf_wrapped(folder, placement, freeze=["model.embed_tokens.*", "lm_head.*"])
    root = engine_of(model).memory_report()["units"]["root"]
    frozen = 2 * VOCAB * 32
    assert root["numel"] - root["trainable_numel"] >= frozen  # neither gradient nor moments cover them
    assert root["states"]["optim"]["bytes"] == 8 * root["trainable_numel"]
    opt = tightfit.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x, y = batch(step)
        model_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_hf_model(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(back.lm_head.weight, ref.lm_head.weight)  # frozen: bit-identical after training
    assert torch.equal(back.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert not torch.equal(back.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)


def test_train_says_its_setup_before_the_plan(tmp_path, capsys):
    """A 7B run spends minutes before its first step (the probe on a new machine, the plan, filling 100 GiB of
    tiers); `tightfit train` says each phase as it starts, so a stalled set-up shows where it stalled."""
    from tightfit.cli import main

    config = llama_config(False)
    config.vocab_size = 256  # the default corpus's byte tokens
    config.save_pretrained(tmp_path / "cfg")
    rc = main(["train", "--model", f"hf:{tmp_path / 'cfg'}", "--offload", "host", "--steps", "1", "--micro-batch",
               "1", "--seq-len", "16", "--eval-interval", "1", "--eval-batches", "1", "--keep-checkpoints", "0",
               "--out-dir", str(tmp_path / "run")])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    setup = [i for i, line in enumerate(lines) if line.startswith("setup: ")]
    said = [lines[i] for i in setup]
    assert said[0].startswith("setup: planning ") and "planned in" in said[1] and "filling the tiers" in said[2]
    assert setup[-1] < next(i for i, line in enumerate(lines) if line.startswith("plan ("))
