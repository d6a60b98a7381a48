"""A fine-tuning setup built in a test, offline: a word-level tokenizer with a chat template, a tiny random Llama
saved as a Hugging Face folder, and JSONL records (chat, prompt/completion, text) of random words."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(90)]
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

# A template with generation markers (transformers' assistant mask, TRL's assistant_only_loss).
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'system' %}<|system|> {{ m['content'] }} <|end|> "
    "{% elif m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The same rendering without markers: tightfit masks it turn by turn.
PLAIN_TEMPLATE = MARKED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def make_tokenizer(folder: Path, template: str = MARKED_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=SPECIAL[3:])
    fast.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def make_llama(folder: Path, vocab: int, seq: int = 64, seed: int = 0, layers: int = 2) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=seq, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _words(rng, 1, 3)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 2)):
            msgs += [{"role": "user", "content": _words(rng, 2, 8)}, {"role": "assistant", "content": _words(rng, 1, 8)}]
        out.append({"messages": msgs})
    return out


def prompt_completion_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _words(rng, 2, 10), "completion": " " + _words(rng, 1, 8)} for _ in range(n)]


def text_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": _words(rng, 3, 20)} for _ in range(n)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def setup(tmp: Path, template: str = MARKED_TEMPLATE, seq: int = 64) -> tuple[Path, Path]:
    """(model folder with its tokenizer, tokenizer folder): the model folder holds both."""
    model = tmp / "llama"
    tok = make_tokenizer(model, template)
    make_llama(model, vocab=len(tok), seq=seq)
    return model, model
