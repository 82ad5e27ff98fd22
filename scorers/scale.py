"""Shared scaling helpers for scorers."""

from __future__ import annotations

from collections.abc import Sequence


def inverted_min_max(values: Sequence[float]) -> list[float]:
    """``(max - v) / (max - min)``: the least loaded gets 1, the most 0; all equal -> all 1."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]
