"""Real fast tokenizers built offline (no hub), in the two shapes fine-tuned models use.

- `byte_level`: GPT-2's shape: byte-level BPE after GPT-2's regex pre-tokenizer (also Llama 3's, Qwen2's, ...).
- `metaspace`: Llama 2's and Mistral's shape: "▁" for spaces, prepended once at the start of the text, no
  pre-tokenizer split (merges may run across whole lines), byte fallback for characters outside the vocabulary.

Each is trained on `text` (a few hundred KB is enough) and saved where `transformers.AutoTokenizer` reads it.
"""

from __future__ import annotations

from pathlib import Path


def byte_level(folder: Path, text: str, vocab: int = 2000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(core, folder, eos="<|endoftext|>")


def metaspace(folder: Path, text: str, vocab: int = 2000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    core.train_from_iterator([text[i:i + 4096] for i in range(0, len(text), 4096)], trainers.BpeTrainer(
        vocab_size=vocab + 258, special_tokens=["<unk>", "</s>", *bytes_]))
    return _save(core, folder, eos="</s>", unk="<unk>")


def _save(core, folder: Path, **special) -> Path:
    import transformers

    names = {"eos": "eos_token", "unk": "unk_token"}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, **{names[k]: v for k, v in special.items()})
    tok.save_pretrained(folder)
    return folder
