"""JSON from files a user or an attacker may have written: a parse error is always a ValueError.

Why: `json.loads` raises RecursionError, not a ValueError, on input nested deep enough (a checkpoint's index.json or
a shard header nested 200,000 levels: a traceback instead of the one-line refusal the callers' `except ValueError`
gives every other bad file; issue 27)."""

from __future__ import annotations

import json


def loads(text: str | bytes):
    """`json.loads`, with too deep a nesting a ValueError like any other malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
