"""Tokenizers behind one small interface: `vocab_size`, `encode(str) -> list[int]`, `decode(list[int]) -> str`.

Why: the data pipeline should not care where tokens come from. The default is byte-level (vocab 256: the UTF-8
bytes of the text; needs nothing, works on any text, and is what the reference GPT trains on). A fine-tuned
Hugging Face model needs its own tokenizer, read from a local folder (`--tokenizer PATH`) with
`transformers.AutoTokenizer`, offline: tightfit never reaches a model hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tightfit.errors import UsageError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens. `decode` replaces byte sequences that are not valid UTF-8 (a sample may end mid-character)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer folder. Encoding adds no special tokens: corpora are token streams."""

    def __init__(self, path: str | Path) -> None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UsageError(f"--tokenizer: {folder} is not a folder; give a local Hugging Face tokenizer folder")
        if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            raise UsageError(f"--tokenizer: {folder} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, "
                             "...); save one there with tokenizer.save_pretrained(folder)")
        try:
            import transformers
        except ImportError:  # pragma: no cover - depends on the environment
            raise UsageError("--tokenizer: needs transformers; pip install 'tightfit[hf]'") from None
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"--tokenizer: transformers cannot read {folder} ({str(e).splitlines()[0]})") from None
        # The corpus is encoded as one long text; the model's max length is irrelevant here, so silence that check.
        self._tok.model_max_length = int(1e30)
        self.path = folder
        self.vocab_size = len(self._tok)  # the base vocabulary plus added tokens: every id encode can return

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    @property
    def gives_offsets(self) -> bool:
        """A fast (Rust) tokenizer says where each id's text is: a corpus is then encoded in pieces
        (train/corpus_encoding.py)."""
        return bool(getattr(self._tok, "is_fast", False))

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids, as `encode` gives them, and each id's (start, end) in that text; one call for all."""
        enc = self._tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                        return_token_type_ids=False)
        return list(zip(enc["input_ids"], enc["offset_mapping"]))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def tokenizer_folder(cfg) -> str | None:
    """The tokenizer a run uses: --tokenizer; for records (a fine-tune), the --model hf:DIR folder's own when it
    holds tokenizer files; None for byte-level tokens."""
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    from tightfit.finetune.records import is_records
    from tightfit.models.build import hf_path

    folder = hf_path(cfg.model.model)
    has_tokenizer = folder is not None and any((Path(folder) / f).is_file() for f in _TOKENIZER_FILES)
    return folder if has_tokenizer and is_records(cfg.data.data) else None


def get_tokenizer(spec: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """`None` -> byte-level tokens; a folder path -> that Hugging Face tokenizer."""
    return ByteTokenizer() if spec is None else HFTokenizer(spec)
