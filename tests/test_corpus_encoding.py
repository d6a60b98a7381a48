"""A tokenizer's corpus is encoded piece by piece (train/corpus_encoding.py) to exactly the ids of one call over the
whole text, holding a piece at a time."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tightfit.models.tokenizer import get_tokenizer
from tightfit.train import corpus_encoding
from tightfit.train.data import load_tokens, stdlib_files

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tokenizer_helpers import byte_level, metaspace


@pytest.fixture(scope="module")
def sample() -> list[str]:
    """Files of real text with the line shapes that matter: indented blocks, blank lines, CRLF, non-ASCII."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()[120:170]]
    return texts + ["\n\n  héllo ✓ 日本語\r\nclass X:\n\tpass\n", "tail without a newline"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, sample):
    root = tmp_path_factory.mktemp("tok")
    train = "\n".join(sample)[:400_000]
    return {"byte_level": get_tokenizer(str(byte_level(root / "bl", train))),
            "metaspace": get_tokenizer(str(metaspace(root / "ms", train)))}


class Spy:
    """The tokenizer, with each call's texts recorded and each cut's verdict counted."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, []
        self.gives_offsets = tok.gives_offsets

    def encode_with_offsets(self, texts):
        self.calls.append([len(t) for t in texts])
        return self.tok.encode_with_offsets(texts)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_pieces_give_the_ids_of_the_whole_text(tokenizers, sample, kind, monkeypatch, tmp_path):
    tok = tokenizers[kind]
    assert tok.gives_offsets
    monkeypatch.setattr(corpus_encoding, "PIECE_CHARS", 4096)
    verdicts = {True: 0, False: 0}
    split = corpus_encoding._split_index

    def counted(starts, ends, pos):
        k = split(starts, ends, pos)
        verdicts[k is not None] += 1
        return k

    monkeypatch.setattr(corpus_encoding, "_split_index", counted)
    text = "\n".join(sample)
    whole = np.asarray(tok.encode(text), dtype=np.int32)
    spy = Spy(tok)
    got = corpus_encoding.encode_corpus((text[i:i + 3000] for i in range(0, len(text), 3000)), spy)
    assert got.dtype == np.int32 and np.array_equal(got, whole)
    # Many pieces, a batch of them per call, none much longer than a piece and its context.
    lengths = [n for call in spy.calls for n in call]
    assert len(lengths) > 50 and max(len(c) for c in spy.calls) == corpus_encoding.BATCH_PIECES
    assert sorted(lengths)[len(lengths) // 2] < 3 * 4096
    if kind == "metaspace":  # merges run across line ends: some cuts are inside a token and are not made
        assert verdicts[False] > 0
    assert verdicts[True] > 50

    # Through the trainer's loader: files joined by a newline, read in chunks, the same ids.
    for i, t in enumerate(sample):
        (tmp_path / f"{i:03d}.txt").write_text(t, encoding="utf-8", newline="")
    monkeypatch.setattr("tightfit.train.data.TEXT_CHUNK_BYTES", 1000)
    from_files = load_tokens(str(tmp_path), tok)
    assert np.array_equal(from_files, np.asarray(tok.encode("\n".join(t.replace("\r\n", "\n") for t in sample)),
                                                 dtype=np.int32))


def test_the_text_is_read_as_it_is_encoded(tokenizers, monkeypatch):
    """The load holds a few batches of text, not the corpus: the first call comes before most chunks are read."""
    monkeypatch.setattr(corpus_encoding, "PIECE_CHARS", 2048)
    read = []

    def chunks():
        for i in range(400):
            read.append(i)
            yield f"def f{i}(x):\n    return x + {i}\n" * 20

    spy = Spy(tokenizers["byte_level"])
    first_call_at = []
    inner = spy.encode_with_offsets

    def at_first(texts):
        first_call_at.append(len(read))
        return inner(texts)

    spy.encode_with_offsets = at_first
    got = corpus_encoding.encode_corpus(chunks(), spy)
    assert first_call_at[0] < 40 and len(first_call_at) > 10
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(400))
    assert np.array_equal(got, np.asarray(tokenizers["byte_level"].encode(text), dtype=np.int32))


def test_a_tokenizer_without_offsets_encodes_the_whole_text():
    class Plain:
        def encode(self, text):
            return [len(w) for w in text.split()]

    got = corpus_encoding.encode_corpus(["ab cde\n", "f ", "gh"], Plain())
    assert got.dtype == np.int32 and got.tolist() == [2, 3, 1, 2]


def test_no_clean_cut_at_all_is_one_piece(tokenizers, monkeypatch):
    """Text with no line start that is not whitespace has no cut: it is encoded whole, the same ids."""
    monkeypatch.setattr(corpus_encoding, "PIECE_CHARS", 256)
    text = "word " * 2000 + "\n  indented\n\tand tabbed" * 50
    tok = tokenizers["byte_level"]
    spy = Spy(tok)
    got = corpus_encoding.encode_corpus([text[i:i + 100] for i in range(0, len(text), 100)], spy)
    assert np.array_equal(got, np.asarray(tok.encode(text), dtype=np.int32))
    assert [len(c) for c in spy.calls] == [1]


def test_a_long_encoding_says_how_far_it_is(tokenizers, tmp_path, monkeypatch):
    """Encoding a large corpus takes minutes (about 3 MB/s a core for a byte-level BPE): the trainer prints how much
    of it is read, the rate and an ETA every PROGRESS_S, from the bytes of the files read. Line ends are made "\\n"
    and undecodable bytes replaced, as `Path.read_text` reads them, also across chunk boundaries."""
    from tightfit.train import data

    texts = [b"hello world\r\n" * 40, "héllo ✓\r\n".encode() * 30 + b"\xff\xfe bad bytes\r", b"last"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_bytes(t)
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", 7)  # splits "\r\n" and multi-byte characters
    ticks = iter(range(0, 10_000, 3))
    lines = []
    chunks = list(data._text_chunks(sorted(tmp_path.iterdir()), lines.append, clock=lambda: float(next(ticks))))
    expected = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(tmp_path.iterdir()))
    assert "".join(chunks) == expected
    total = sum(len(t) for t in texts)
    said = [re.fullmatch(r"encoding --data with the tokenizer: (\d+) B of (\d+) B, \d+ B/s, ETA (\d+)m(\d\d)s", x)
            for x in lines]
    assert len(said) > 10 and all(said), lines
    done = [int(m.group(1)) for m in said]
    assert done == sorted(done) and total - 4 * 7 <= done[-1] < total  # a line every 4th chunk of 7 bytes
    assert {int(m.group(2)) for m in said} == {total}
    eta = [60 * int(m.group(3)) + int(m.group(4)) for m in said]
    assert eta == sorted(eta, reverse=True) and eta[0] > 300 and eta[-1] <= 12  # 2 B/s: the bytes left at that rate
    tok = tokenizers["byte_level"]
    assert np.array_equal(load_tokens(str(tmp_path), tok), np.asarray(tok.encode(expected), dtype=np.int32))
