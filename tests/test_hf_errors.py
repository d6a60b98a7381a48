"""Bad checkpoint folders fail with one UsageError line naming the file and what to do; pickles are never read."""

from __future__ import annotations

import json
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tightfit.errors import UsageError  # noqa: E402
from tightfit.models.hf_load import load_hf_model  # noqa: E402


def tiny_llama(vocab=64):
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=vocab, tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=0)


@pytest.fixture
def sharded(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(tmp_path / "m", max_shard_size="8KB")
    return tmp_path / "m"


def test_not_a_folder(tmp_path):
    with pytest.raises(UsageError, match="not a folder"):
        load_hf_model(tmp_path / "nope")


def test_folder_without_config(tmp_path, sharded):
    (sharded / "config.json").unlink()
    with pytest.raises(UsageError, match=r"m: no config\.json"):
        load_hf_model(sharded)


def test_shard_missing_from_folder(sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(UsageError, match=f"{victim.name}: shard listed in model.safetensors.index.json"):
        load_hf_model(sharded)


def test_index_names_tensor_the_shard_lacks(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.extra.weight"] = first
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UsageError, match=f"{first}: .*holds tensor 'model.layers.0.extra.weight'"):
        load_hf_model(sharded)


def test_shards_without_index(sharded):
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(UsageError, match="no model.safetensors.index.json"):
        load_hf_model(sharded)


def test_mismatched_shapes_name_tensor_file_and_both_shapes(sharded):
    tiny_llama(vocab=80).save_pretrained(sharded)  # config now disagrees with the weights
    with pytest.raises(UsageError, match=r"model-\d+-of-\d+\.safetensors: tensor 'model\.embed_tokens\.weight' has "
                                         r"shape \[64, 16\] but the model built from config\.json expects \[80, 16\]"):
        load_hf_model(sharded)


def test_pickle_only_checkpoint_is_refused_unread(tmp_path):
    folder = tmp_path / "pkl"
    tiny_llama().save_pretrained(folder)
    # Not a valid pickle: if anything tried to unpickle it, the error would be an UnpicklingError, not ours.
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 definitely not safe to unpickle")
    with pytest.raises(UsageError, match=r"pytorch_model\.bin.*never loads pickles.*safetensors"):
        load_hf_model(folder)


def test_missing_tensors_are_an_error_unless_not_strict(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["lm_head.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(UsageError, match=r"lacks 1 tensors the model needs, e.g. \['lm_head.weight'\]"):
        load_hf_model(sharded)
    model = load_hf_model(sharded, strict=False)
    assert 0.01 < model.lm_head.weight.std().item() < 0.03  # initialised by the model's own init


def test_corrupt_safetensors_header(tmp_path, sharded):
    single = tmp_path / "single"
    transformers.AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(single)
    raw = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json}" + raw[100:])
    with pytest.raises(UsageError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf_model(single)


def test_truncated_shard(tmp_path):
    single = tmp_path / "single"
    transformers.AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(single)
    f = single / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(UsageError, match=r"model\.safetensors: tensor .*past the end of the file"):
        load_hf_model(single)


def test_unexpected_tensors_are_reported_and_ignored(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "extra"
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama())
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.rotary_emb.inv_freq"] = torch.ones(4)  # as old Llama checkpoints store it
    model.config.save_pretrained(folder)
    save_file(tensors, folder / "model.safetensors")
    with pytest.warns(UserWarning, match=r"ignoring 1 checkpoint tensors .*model\.rotary_emb\.inv_freq"):
        loaded = load_hf_model(folder)
    assert not torch.equal(loaded.model.rotary_emb.inv_freq, torch.ones(4))  # recomputed, not the stray tensor


def test_a_weights_file_without_tensors_and_integer_weights_are_refused(tmp_path):
    """An empty model.safetensors trained from random weights with exit 0; an integer tensor of the right shape
    failed deep in torch with a RuntimeError (issue 27)."""
    from safetensors.torch import save_file

    folder = tmp_path / "m"
    folder.mkdir()
    tiny_llama().save_pretrained(folder)
    save_file({}, str(folder / "model.safetensors"))
    with pytest.raises(UsageError, match=r"model\.safetensors: holds no tensor"):
        load_hf_model(folder)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(tiny_llama()).state_dict()
    state = {k: v.contiguous() for k, v in state.items()}
    state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=torch.int32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(UsageError, match=r"tensor 'model\.norm\.weight' is stored as int32"):
        load_hf_model(folder)
