"""The exception types the CLI turns into one `error: ...` line, and the hint that goes with a misspelling."""

from __future__ import annotations

import difflib
from typing import Iterable


class UserError(Exception):
    """Bad input from the user: printed as one line, never as a traceback (exit 2)."""


class TrainingFailed(Exception):
    """The algorithm failed mid-run (exit 1); the checkpoints written so far stay."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
