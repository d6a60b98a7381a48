"""Tokenizers (bytes, a local Hugging Face folder) and build_model / model_loss for both kinds of model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tightfit.config import ModelConfig
from tightfit.errors import UsageError
from tightfit.models.build import build_model, model_logits, model_loss
from tightfit.models.gpt import GPT
from tightfit.models.tokenizer import ByteTokenizer, get_tokenizer

transformers = pytest.importorskip("transformers")


def test_byte_tokenizer_round_trips_utf8():
    tok = get_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    ids = tok.encode("héllo ✓")
    assert max(ids) < 256 and tok.decode(ids) == "héllo ✓"
    assert tok.decode(ids[:-1]).startswith("héllo ")  # a cut multi-byte character decodes, replaced


def _word_level_tokenizer(folder):
    """A real fast tokenizer built offline (no hub): word-level over a tiny vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "tight": 3, "fit": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.save_pretrained(folder)
    return tok


def test_hf_tokenizer_folder_matches_transformers(tmp_path):
    ref = _word_level_tokenizer(tmp_path / "tok")
    tok = get_tokenizer(str(tmp_path / "tok"))
    text = "hello world tight fit nope " * 3
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.vocab_size == len(ref) == 5
    assert tok.decode(tok.encode("hello fit")) == ref.decode(ref.encode("hello fit", add_special_tokens=False))


def test_bad_tokenizer_folders(tmp_path):
    with pytest.raises(UsageError, match="--tokenizer: .* is not a folder"):
        get_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="--tokenizer: .*empty holds no tokenizer files"):
        get_tokenizer(str(tmp_path / "empty"))


def _llama_folder(tmp_path, weights: bool):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    folder = tmp_path / ("w" if weights else "cfg")
    if weights:
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    return folder


def test_build_gpt_and_loss_convention():
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32), vocab_size=256, block_size=16)
    assert isinstance(model, GPT) and model.training
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    logits = model_logits(model, x)
    torch.testing.assert_close(model_loss(model, x, y), F.cross_entropy(logits.view(-1, 256), y.view(-1)))


@pytest.mark.parametrize("weights", [True, False])
def test_build_hf_model(tmp_path, weights):
    folder = _llama_folder(tmp_path, weights)
    model = build_model(ModelConfig(model=f"hf:{folder}"), vocab_size=256, block_size=32)
    assert model.training and not any(p.is_meta for p in model.parameters())
    x = torch.randint(0, 256, (2, 32))
    loss = model_loss(model, x[:, :-1], x[:, 1:])
    assert loss.ndim == 0 and 4.0 < loss.item() < 7.5  # about ln(300) for a fresh model
    loss.backward()


def test_build_hf_model_bad_inputs(tmp_path):
    folder = _llama_folder(tmp_path, False)
    with pytest.raises(UsageError, match="--model: expected 'gpt' or 'hf:PATH'"):
        build_model(ModelConfig(model="llama"), 256, 32)
    with pytest.raises(UsageError, match="--tokenizer: gives token ids up to 511, .* vocab_size 300"):
        build_model(ModelConfig(model=f"hf:{folder}"), 512, 32)
    with pytest.raises(UsageError, match="--seq-len: 128 exceeds the 64 positions"):
        build_model(ModelConfig(model=f"hf:{folder}"), 256, 128)
    with pytest.raises(UsageError, match="no config.json"):
        build_model(ModelConfig(model=f"hf:{tmp_path}"), 256, 32)


def test_build_hf_meta_then_wrap_and_import(tmp_path):
    """The larger-than-RAM path for the trainer: meta model, wrap, values through import_state's `get`."""
    import tightfit
    from tightfit.models.hf_load import HFCheckpoint, load_hf_model
    from tightfit.models.hf_wrap import checkpoint_values
    from tightfit.offload.model_state.state_io import import_state

    folder = _llama_folder(tmp_path, True)
    model = build_model(ModelConfig(model=f"hf:{folder}"), vocab_size=256, block_size=32, device="meta")
    assert all(p.is_meta for p in model.parameters())
    tightfit.wrap(model, tightfit.Placement.everywhere("host"))
    with checkpoint_values(HFCheckpoint.open(folder)) as get:
        import_state(model, None, get)
        with pytest.raises(KeyError):
            get("optim.lm_head.weight.exp_avg")
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, load_hf_model(folder)(x).logits, rtol=1e-5, atol=1e-6)
