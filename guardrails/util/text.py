"""Small text helpers shared by the messages, so lists are cut the same way everywhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def shorten(items: Sequence[Any], n: int) -> str:
    """The first ``n`` items, comma-separated, then ``... k more`` if there are more."""
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (f", ... {len(items) - n} more" if len(items) > n else "")


def si(value: float, unit: str) -> str:
    """``1.23 TFLOP``: a count with its SI prefix (FLOPs, FLOP/s in messages and the
    report alike)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
