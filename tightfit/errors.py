"""The one exception type that reaches the user as a one-line message.

Why: bad input (a flag, a file, a checkpoint) must produce a clear line naming what is wrong and what to do, exit
status 2 and no traceback. Code anywhere in tightfit raises `UsageError`; the CLI catches it, prints
`tightfit: error: <message>` and exits 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user. The message names the flag or file and says what to do."""

    exit_code = 2
