"""Small text helpers shared by the messages, so lists are cut the same way everywhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def shorten(items: Sequence[Any], n: int) -> str:
    """The first ``n`` items, comma-separated, then ``... k more`` if there are more."""
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (f", ... {len(items) - n} more" if len(items) > n else "")
