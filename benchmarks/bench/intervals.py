"""How sure a world's ranking is: bootstrap intervals of one target's TTFT percentile over
another's.

A world of a sweep serves tens to a few hundred requests, so its p90 rests on the slowest few:
two runs of one scheduler differ by 10-40% in small worlds (docs/benchmarks/sweep.md). The
interval says which of a target's losses the run's own sample size cannot explain: where even
its low end is above a bar, the loss is clear; where it holds the bar, one more run may not
show it. It is the sampling error of the requests alone (each target's requests resampled
independently), not the run-to-run spread of placement, so it is a lower bound on the
uncertainty, never an excuse for a loss.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

RESAMPLES = 1000
LEVEL = 0.95


def resampled_percentile(ordered: Sequence[float], q: float, rng: random.Random) -> float:
    """The ``q``-th percentile (interpolated as metrics.percentile is) of one bootstrap resample
    of the sorted ``ordered``, drawn without building the resample: the resample's k-th
    smallest value is ``ordered[j]`` for j the k-th smallest of n uniform indices, whose
    position is Beta(k, n - k + 1); the next one lies above it by Beta(1, n - k - 1) of the
    rest."""
    n = len(ordered)
    pos = (n - 1) * q / 100.0
    k = math.floor(pos)
    if k >= n - 1:
        return _at(ordered, rng.betavariate(n, 1))
    u = rng.betavariate(k + 1, n - k)
    v = u + (1.0 - u) * rng.betavariate(1, n - k - 1)
    lo, hi = _at(ordered, u), _at(ordered, v)
    return lo + (hi - lo) * (pos - k)


def _at(ordered: Sequence[float], u: float) -> float:
    return ordered[min(len(ordered) - 1, int(u * len(ordered)))]


def ratio_interval(
    values: Sequence[float],
    best: Sequence[float],
    q: float = 90.0,
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The central ``level`` interval of resampled percentile(values) / percentile(best), or
    None where either has fewer than two samples or the best's resamples reach zero.
    Deterministic for a ``seed``."""
    if len(values) < 2 or len(best) < 2:
        return None
    rng = random.Random(seed)
    a, b = sorted(values), sorted(best)
    out = []
    for _ in range(resamples):
        denominator = resampled_percentile(b, q, rng)
        if denominator <= 0:
            return None
        out.append(resampled_percentile(a, q, rng) / denominator)
    out.sort()
    tail = (1.0 - level) / 2
    return out[int(tail * (resamples - 1))], out[math.ceil((1.0 - tail) * (resamples - 1))]
