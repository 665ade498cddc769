"""The console every layer writes to (rich): plain lines and number formatting."""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console

stdout = Console(highlight=False, soft_wrap=True)


def say(text: str, **kwargs: Any) -> None:
    """A plain line: run directories, commands and other user text are never read as rich markup."""
    stdout.print(text, markup=False, **kwargs)


def fmt(value: Optional[float], spec: str, missing: str = "-") -> str:
    """`value` formatted with `spec`, or `missing` where there is none."""
    return missing if value is None else format(value, spec)
