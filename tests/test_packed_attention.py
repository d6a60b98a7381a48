"""Packed rows keep each example's attention to itself: the reference GPT with its own mask, Hugging Face models
through restarting position ids, checked per architecture; one that attends across examples refuses --packing."""

from __future__ import annotations

import pytest
import torch
import transformers

import sft_helpers as h
from tightfit.cli import main
from tightfit.finetune.packed_attention import attends_within_examples
from tightfit.models.gpt import GPT, GPTConfig


def test_the_reference_gpt_attends_within_each_packed_example():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    a, b = torch.randint(0, 50, (1, 6)), torch.randint(0, 50, (1, 5))
    row = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], 1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        packed = model(row, positions=positions)
        torch.testing.assert_close(packed[:, :6], model(a), rtol=0, atol=1e-6)
        torch.testing.assert_close(packed[:, 6:11], model(b), rtol=0, atol=1e-6)
        assert (model(row)[:, 6:11] - model(b)).abs().max() > 1e-3  # without positions it attends across


@pytest.mark.parametrize("model_type,keeps", [("llama", True), ("qwen2", True), ("gpt2", True), ("gpt_neox", True),
                                              ("opt", False), ("no-such-model", None)])
def test_the_check_tells_which_architectures_keep_packed_examples_apart(model_type, keeps):
    assert attends_within_examples(model_type) is keeps


def test_a_model_that_attends_across_examples_refuses_packing_in_one_line(tmp_path, capsys):
    folder = tmp_path / "opt"
    tok = h.make_tokenizer(folder)
    cfg = transformers.OPTConfig(vocab_size=len(tok), num_hidden_layers=1, hidden_size=16, ffn_dim=32,
                                 num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.OPTForCausalLM(cfg).save_pretrained(folder)
    data = h.write_jsonl(tmp_path / "chat.jsonl", h.chat_records(20))
    capsys.readouterr()
    args = ["train", "--model", f"hf:{folder}", "--data", str(data), "--seq-len", "64", "--micro-batch", "2",
            "--steps", "2", "--out-dir", str(tmp_path / "run"), "--keep-checkpoints", "0", "--tensorboard", "off"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tightfit: error: --packing: the opt model of {folder} attends across examples packed into a row "
                   "(its attention ignores restarting position ids); pass --no-packing (one example a row)")
    assert main([*args, "--no-packing"]) == 0
