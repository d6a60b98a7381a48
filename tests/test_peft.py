"""PEFT / LoRA over a wrapped model: the frozen base is kept once, in the compute dtype, with no master, gradient or
moments (the engine's byte accounting says so); a LoRA fine-tune through TightfitTrainer has the losses of peft
without tightfit, and its adapters save and reload with peft's own calls."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import tightfit
from tightfit.offload.step.engine import engine_of
from tightfit.offload.placement import Tier
from tightfit.offload.model_state.state_io import export_state
from tightfit.optim import AdamW
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)

VOCAB, SEQ = 128, 16


def base_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def lora_llama():
    base = base_llama()
    torch.manual_seed(1)  # LoRA's B starts at zero by default; gaussian init makes the adapters matter from step 1
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights="gaussian")
    return peft.get_peft_model(base, lora)


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + i))


def test_frozen_base_has_no_master_grad_or_moments(tmp_path):
    """bf16 compute: each unit stores its params once in bf16 (2 B/element, base included) and fp32 master,
    gradients and moments (16 B) for the adapters only. Before the fix the master covered the frozen base too."""
    model = lora_llama()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen > 20 * trainable
    tightfit.wrap(model, tightfit.Placement.everywhere("host"), compute_dtype=torch.bfloat16, device="cpu")
    engine = engine_of(model)
    units = engine.units.values()
    # The params and gradients a GPU copies from and into are page-locked, each entry its own pages (the suite's
    # device is GPU-shaped).
    page = (lambda n: -(-n // 4096) * 4096) if engine.separate else (lambda n: n)
    expected = sum(page(2 * u.spec.numel) + page(4 * u.spec.train_numel) + 12 * u.spec.train_numel for u in units)
    assert engine.stores[Tier.HOST].bytes == expected
    for u in units:
        report = engine.unit_report(u)["states"]
        assert report["master"]["bytes"] == 4 * u.spec.train_numel
        assert report["grads"]["bytes"] == 4 * u.spec.train_numel and report["optim"]["bytes"] == 8 * u.spec.train_numel
    # Padding aside, the trainable prefixes are the adapters.
    assert sum(u.spec.train_numel for u in units) < 2 * trainable
    engine.close()


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_frozen_values_survive_steps_on_every_tier(tmp_path, compute_dtype):
    """The step refreshes only the trainable prefix of each compute copy: frozen values never move, on the device
    tier (cast in place), the host tier, and NVMe (the prefix alone written, the frozen tail never read);
    the three placements give the same losses."""
    runs = {}
    for tier in ("device", "host", "nvme"):
        p = tightfit.Placement.everywhere(tier, nvme_dir=str(tmp_path / f"swap-{tier}"))
        if compute_dtype == torch.float32:  # a separate fp32 master with fp32 compute: params and master apart
            p.default = tightfit.UnitPlacement(params=Tier(tier), master=Tier.HOST if tier != "host" else Tier.DEVICE,
                                               grads=Tier(tier), optim=Tier(tier))
        model = lora_llama()
        before = {n: t.clone() for n, t in model.named_parameters()}
        tightfit.wrap(model, p, compute_dtype=compute_dtype, device="cpu")
        opt = AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
        losses = []
        for i in range(3):
            x = batch(i)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        after = dict(export_state(model))
        for name, p0 in before.items():
            value = after[f"model.{name}"]
            if "lora_" in name:
                assert not torch.equal(value, p0), name
            else:  # frozen: exactly its value in the compute dtype
                assert torch.equal(value, p0.to(compute_dtype).float()), name
        runs[tier] = losses
        engine_of(model).close()
    assert runs["device"] == runs["host"] == runs["nvme"]


def test_lora_trainer_matches_peft_and_adapters_round_trip(tmp_path):
    from tightfit.integrations.hf_trainer import TightfitTrainer

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(48):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})

    def args(folder):
        return transformers.TrainingArguments(
            output_dir=str(folder), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
            lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=0.2, weight_decay=0.1, logging_steps=1,
            report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)

    stock = transformers.Trainer(model=lora_llama(), args=args(tmp_path / "stock"), train_dataset=data)
    stock.train()
    ours = TightfitTrainer(model=lora_llama(), args=args(tmp_path / "ours"), train_dataset=data,
                           placement=tightfit.Placement.everywhere("nvme", nvme_dir=str(tmp_path / "swap")))
    ours.train()
    ref = [(h["loss"], h["grad_norm"]) for h in stock.state.log_history if "loss" in h]
    got = [(h["loss"], h["grad_norm"]) for h in ours.state.log_history if "loss" in h]
    assert len(got) == len(ref) == 6
    for (a, an), (b, bn) in zip(got, ref):
        assert abs(a - b) <= 1e-6 * b and abs(an - bn) <= 1e-6 * bn
    assert any(n > 0.2 for _, n in ref)  # clipped

    # Adapters through peft's own save_pretrained / PeftModel.from_pretrained.
    ours.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the base is not saved again
    base = base_llama()  # same seed: the same base weights
    reloaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    x = batch(9)
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
        plain = stock.model.eval()(input_ids=x).logits
        mine = ours.model.eval()(input_ids=x).logits
    assert torch.equal(mine, theirs)
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=1e-6)
