"""Where fine-tuning records come from, and which of the three formats they are in.

Why: the data people fine-tune on is records, not a text stream: JSON Lines or Parquet files (or a folder of them),
or a folder written by `datasets.Dataset.save_to_disk`, each record one of
- `{"text": ...}`: a document, all of it trained on;
- `{"prompt": ..., "completion": ...}`: the loss on the completion (strings, or lists of chat messages);
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, the loss on the assistant's turns.
The format is read off the first record (`--data-format` forces one where the fields would fit two); every record
after it must have that format's fields. A record that is not what it claims is one line naming the file, the
record's number (its line in a JSON Lines file, its row in the others, from 1) and what is wrong (`BadRecord`);
`--skip-bad-records` counts and skips such records instead. Parquet and `datasets` folders are read with pyarrow
(installed with `datasets`), a batch of rows at a time: the records are never all in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tightfit.errors import UsageError

FORMATS = ("text", "prompt-completion", "messages")
"""The record formats, as --data-format names them."""
RECORD_SUFFIXES = (".jsonl", ".parquet")
"""Files read as records; a folder is records when it holds any (or is a `datasets` folder)."""
_FIELDS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion"), "text": ("text",)}


class BadRecord(UsageError):
    """One record that cannot be trained on: `where` names it (file and number), `what` says why."""

    def __init__(self, where: str, what: str, flag: str = "--data") -> None:
        self.where, self.what, self.flag = where, what, flag
        super().__init__(f"{flag}: {where}: {what}; fix it, or pass --skip-bad-records to skip such records")


def is_records(path: str | None) -> bool:
    """Does `--data` name records (a .jsonl or .parquet file, a folder of them, a `datasets` folder)?"""
    if path is None:
        return False
    p = Path(path)
    if p.is_file():
        return p.suffix.lower() in RECORD_SUFFIXES
    if not p.is_dir():
        return False
    if _datasets_folder(p) is not None:
        return True
    return any(f.suffix.lower() in RECORD_SUFFIXES for f in p.rglob("*") if f.is_file())


def record_files(path: str, flag: str = "--data") -> list[Path]:
    """The files of the records `path` names, in a fixed order: itself, a `datasets` folder's arrow files in the
    order it lists them (its train split for a DatasetDict), or a folder's .jsonl and .parquet files, sorted."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag}: {p} does not exist; give a .jsonl or .parquet file, or a folder of them")
    if p.is_file():
        if p.suffix.lower() not in RECORD_SUFFIXES:
            raise UsageError(f"{flag}: {p} is not a .jsonl or .parquet file")
        return [p]
    arrow = _datasets_folder(p)
    if arrow is not None:
        return arrow
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in RECORD_SUFFIXES)
    if not files:
        raise UsageError(f"{flag}: no .jsonl or .parquet files under {p}")
    return files


def held_out_split(path: str) -> str | None:
    """The held-out split of a `datasets.DatasetDict` folder (validation, else test), or None."""
    p = Path(path)
    for name in ("validation", "test"):
        if (p / "dataset_dict.json").is_file() and (p / name / "state.json").is_file():
            return str(p / name)
    return None


def _datasets_folder(p: Path) -> list[Path] | None:
    """The arrow files of a folder `save_to_disk` wrote (state.json lists them), its train split's for a
    DatasetDict; None for another folder."""
    if (p / "dataset_dict.json").is_file():
        split = p / "train"
        if not (split / "state.json").is_file():
            raise UsageError(f"--data: {p} is a datasets.DatasetDict folder without a train split; name the split's "
                             "folder itself")
        p = split
    state = p / "state.json"
    if not state.is_file():
        return None
    try:
        listed = [p / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--data: cannot read {state} ({e}); save the dataset again with save_to_disk") from None
    for f in listed:
        if not f.is_file() or f.parent.resolve() != p.resolve():
            raise UsageError(f"--data: {state} lists {f.name}, which is not a file in {p}; save the dataset again")
    return listed


def read_records(files: list[Path], flag: str = "--data") -> Iterator[tuple[str, object]]:
    """(where, record) for every record of `files` in order; `where` is "FILE line N" or "FILE row N". A line that
    is not JSON comes as (where, BadRecord): the caller decides whether it stops the run."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl(f, flag)
        else:
            yield from _arrow_rows(f, flag)


def _jsonl(f: Path, flag: str) -> Iterator[tuple[str, object]]:
    try:
        fh = open(f, "rb")
    except OSError as e:
        raise UsageError(f"{flag}: cannot read {f} ({e.strerror or e})") from None
    with fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{f} line {n}"
            try:
                yield where, json.loads(raw)
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
                yield where, BadRecord(where, f"not JSON ({str(e).splitlines()[0][:80]})", flag)


def _arrow_rows(f: Path, flag: str, batch_rows: int = 1024) -> Iterator[tuple[str, object]]:
    """Rows of a Parquet file or of an arrow stream file (`save_to_disk`'s), a batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{flag}: reading {f.name} needs pyarrow; pip install pyarrow (it comes with datasets)") \
            from None
    kind = "Parquet" if f.suffix.lower() == ".parquet" else "arrow"
    try:
        if kind == "Parquet":
            batches = pq.ParquetFile(f).iter_batches(batch_size=batch_rows)
        else:
            batches = iter(pa.ipc.open_stream(pa.memory_map(str(f))))
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield f"{f} row {n}", row
    except (OSError, pa.ArrowException) as e:
        raise UsageError(f"{flag}: {f} is not a readable {kind} file ({str(e).splitlines()[0][:120]})") from None


def detect_format(record: object, where: str, forced: str = "auto", flag: str = "--data") -> str:
    """The format of the data, from its first record (or `forced`, --data-format)."""
    if forced != "auto":
        return forced
    if not isinstance(record, dict):
        raise BadRecord(where, f"is a JSON {type(record).__name__}, not an object with text, prompt/completion or "
                               "messages fields", flag)
    found = [name for name, keys in _FIELDS.items() if all(k in record for k in keys)]
    if not found:
        raise UsageError(f"{flag}: {where} has fields {sorted(record)[:8]}, none of the formats tightfit reads "
                         "(text; prompt and completion; messages); rename the fields")
    if len(found) > 1:
        raise UsageError(f"{flag}: {where} has the fields of {' and '.join(found)}; say which with --data-format")
    return found[0]


def fields_of(record: object, fmt: str, where: str, flag: str = "--data") -> tuple:
    """The format's fields of `record`, checked: present, of the right kind, the answer not empty."""
    if not isinstance(record, dict):
        raise BadRecord(where, f"is a JSON {type(record).__name__}, not an object", flag)
    missing = [k for k in _FIELDS[fmt] if k not in record or record[k] is None]
    if missing:
        raise BadRecord(where, f"has no {' or '.join(repr(k) for k in missing)} field (the data is {fmt} records)",
                        flag)
    values = tuple(record[k] for k in _FIELDS[fmt])
    if fmt == "text":
        if not isinstance(values[0], str):
            raise BadRecord(where, f"'text' is a {type(values[0]).__name__}, not a string", flag)
        if not values[0]:
            raise BadRecord(where, "'text' is empty", flag)
    elif fmt == "prompt-completion":
        prompt, completion = values
        if isinstance(prompt, str) != isinstance(completion, str):
            raise BadRecord(where, "'prompt' and 'completion' must both be strings or both be lists of messages",
                            flag)
        if isinstance(prompt, str):
            if not completion.strip():
                raise BadRecord(where, "the completion is empty: nothing to train on", flag)
        else:
            check_messages(prompt, where, "prompt", flag)
            check_messages(completion, where, "completion", flag)
            if not completion:
                raise BadRecord(where, "the completion has no messages: nothing to train on", flag)
    else:
        check_messages(values[0], where, "messages", flag)
        if not values[0]:
            raise BadRecord(where, "'messages' is empty", flag)
    return values


def check_messages(messages: object, where: str, field: str, flag: str = "--data") -> None:
    """A list of {"role": str, "content": str} objects, no assistant turn empty."""
    if not isinstance(messages, list):
        raise BadRecord(where, f"'{field}' is a {type(messages).__name__}, not a list of messages", flag)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(where, f"'{field}' item {i} is not a message with a string 'role'", flag)
        content = m.get("content")
        if not isinstance(content, str) and content is not None:
            raise BadRecord(where, f"'{field}' item {i} ({m['role']}) has a {type(content).__name__} content, not a "
                                   "string", flag)
        if m["role"] == "assistant" and not (content or "").strip():
            raise BadRecord(where, f"'{field}' item {i} is an empty assistant answer", flag)
