"""The fleet's first-byte cost fit: an exponentially weighted ridge regression of each first
byte on what stood in front of it, bounded to what an inference engine can be.

Regressors: the request's own uncached tokens, the tokens queued ahead, the running requests,
the requests queued ahead. Each coefficient is pulled towards vLLM's shape (a queued token
costs an own one, a running request ``running_tokens`` of them, a queued request nothing
beyond its tokens) as far as its count lacks spread in the samples. Why, and what it replaced:
docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CostPriors:
    overhead_s: float = 0.030
    per_token_s: float = 0.0002
    # Fleet samples before the fleet fit is trusted fully; until then it is blended with the
    # priors.
    warmup_samples: int = 20
    # Weight of the past per sample: the fleet, fed by every endpoint, forgets a sample with a
    # half-life of ~70 samples; an endpoint's factor, with one of ~35 of its own.
    decay: float = 0.99
    endpoint_decay: float = 0.98
    # Residuals beyond this many seconds (or the prediction, if larger) count as this many (a
    # stall, a GC pause, a preemption).
    clip_s: float = 1.0
    # What a running request adds to a first byte, in prompt tokens (its decode share of the
    # steps a prefill runs in: ~8 ms on the 8B-on-H100 profile, i.e. ~40 tokens), so that the
    # prior scales with the hardware's learned speed.
    running_tokens: float = 40.0
    # Strength of the prior slope, as the spread (standard deviation, tokens) of token counts
    # at which the samples weigh as much as the prior (ridge regression towards it). Prompts
    # of nearly one size say little about the cost of a token, and a slope fitted to their
    # noise can collapse to nothing, which would make a recompute free and herd traffic.
    # Agentic traffic, spread over thousands of tokens, overrides the prior almost entirely
    # (it keeps 1% of the weight at a spread of 1,000 tokens, 80% at 50).
    prior_spread_tokens: float = 100.0
    # The same for the queued tokens' price, the running requests' cost and the queued
    # requests' own cost: samples with a queue spread over ~1,000 tokens, running counts over
    # ~4 requests, or queue lengths over ~1 request, weigh as much as the prior.
    prior_spread_queued_tokens: float = 1000.0
    prior_spread_running: float = 4.0
    prior_spread_queued_requests: float = 1.0
    # An endpoint's speed factor counts w / (w + this) of its own evidence (in log space; w:
    # its decayed sample weight, at most 1 / (1 - endpoint_decay) = 50, so at most ~83%).
    endpoint_pseudo_samples: float = 10.0
    # An endpoint's evidence halves for every this many seconds without a sample of its own.
    stale_half_life_s: float = 30.0


# Coefficients: own token, queued token, running request, queued request.
_OWN, _QUEUED, _RUNNING, _PER_REQUEST = range(4)
_REGRESSORS = 4
# Solves of one fit, each adding the bounds the last one broke (four coefficients, each bound
# once at most, so a handful settle it).
_MAX_ACTIVE_SET_ROUNDS = 6


@dataclass(slots=True)
class CostFit:
    """Exponentially weighted sums for least squares on y = a + beta . x, x the counts of
    ``Calibrator.observe``, and the last solve's coefficients."""

    w: float = 0.0
    sx: list[float] = field(default_factory=lambda: [0.0] * _REGRESSORS)
    sy: float = 0.0
    sxx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * _REGRESSORS for _ in range(_REGRESSORS)]
    )
    sxy: list[float] = field(default_factory=lambda: [0.0] * _REGRESSORS)
    samples: int = 0
    overhead_s: float = 0.0
    # Seconds per own token, per queued token, per running request, per queued request.
    beta: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def add(self, x: tuple[float, float, float, float], y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sy = self.sy * decay + y
        for i in range(_REGRESSORS):
            self.sx[i] = self.sx[i] * decay + x[i]
            self.sxy[i] = self.sxy[i] * decay + x[i] * y
            row = self.sxx[i]
            for j in range(_REGRESSORS):
                row[j] = row[j] * decay + x[i] * x[j]
        self.samples += 1

    def solve(self, priors: CostPriors) -> None:
        mean = [v / self.w for v in self.sx]
        mean_y = self.sy / self.w
        matrix = [
            [self.sxx[i][j] / self.w - mean[i] * mean[j] for j in range(_REGRESSORS)]
            for i in range(_REGRESSORS)
        ]
        vector = [self.sxy[i] / self.w - mean[i] * mean_y for i in range(_REGRESSORS)]
        spreads = (
            priors.prior_spread_tokens, priors.prior_spread_queued_tokens,
            priors.prior_spread_running, priors.prior_spread_queued_requests,
        )
        ridge = [max(s, 1e-3) ** 2 for s in spreads]
        # The queued and running prices are pulled towards what they cost at the own tokens'
        # *learned* speed, so the fit is solved twice: unbounded against the prior's speed for
        # that speed, then within bounds against it. Each price is pulled only towards its own
        # prior and bounded on its own: tied to the own-token slope (a queued token costing at
        # most an own one), a queue shown free (prefills side by side) dragged the slope to its
        # floor while every prompt was one size, a queue shown dear (requests waiting for a
        # sequence slot) pushed it up, and either way a recompute was mispriced.
        p = priors.per_token_s
        start = (p, p, p * priors.running_tokens, 0.0)
        first = _solve_held(matrix, vector, ridge, start, {})
        low, high = _bounds(first, priors)[_OWN]
        speed = min(max(first[_OWN], low), high)
        prior = (p, speed, speed * priors.running_tokens, 0.0)
        beta = _bounded_ridge(matrix, vector, ridge, prior, priors)
        self.beta = (beta[0], beta[1], beta[2], beta[3])
        intercept = mean_y - sum(b * m for b, m in zip(self.beta, mean, strict=True))
        self.overhead_s = min(max(intercept, 0.0), 60.0)


def _bounds(beta: Sequence[float], priors: CostPriors) -> list[tuple[float, float]]:
    """Sane bounds: an own token between a hundredth of the prior and 100x it; a queued token
    between nothing and 100x the prior; a running request between nothing and its share of
    the steps at the learned speed plus 99x the prior's share; a queued request between
    nothing and 10x the prior overhead beyond its tokens."""
    p, running = priors.per_token_s, priors.running_tokens
    low, high = p / 100, p * 100
    own = min(max(beta[_OWN], low), high)
    return [
        (low, high), (0.0, high), (0.0, running * (own + 99 * p)), (0.0, 10 * priors.overhead_s),
    ]


def _bounded_ridge(
    matrix: list[list[float]],
    vector: list[float],
    ridge: list[float],
    prior: Sequence[float],
    priors: CostPriors,
) -> list[float]:
    """The ridge solution within ``_bounds``: a coefficient that breaks a bound is held at it
    and the others are solved again, so what the bound cuts off is refitted rather than left
    to the intercept. The active set only grows: a coefficient held is never released, which
    can miss the exact optimum when two break at once (first bytes falling as prompts grow,
    say), a case no engine produces."""
    held: dict[int, float] = {}
    beta = list(prior)
    for _ in range(_MAX_ACTIVE_SET_ROUNDS):
        beta = _solve_held(matrix, vector, ridge, prior, held)
        broken = {
            i: min(max(b, low), high)
            for i, (b, (low, high)) in enumerate(zip(beta, _bounds(beta, priors), strict=True))
            if i not in held and not low <= b <= high
        }
        if not broken:
            break
        held.update(broken)
    bounds = _bounds(beta, priors)
    return [min(max(b, low), high) for b, (low, high) in zip(beta, bounds, strict=True)]


def _solve_held(
    matrix: list[list[float]],
    vector: list[float],
    ridge: list[float],
    prior: Sequence[float],
    held: dict[int, float],
) -> list[float]:
    """Minimise b'Mb - 2v'b + sum ridge_i (b_i - prior_i)^2 over the coefficients not in
    ``held``, the others fixed at their held values."""
    n = len(vector)
    free = [i for i in range(n) if i not in held]
    const = [held.get(i, 0.0) for i in range(n)]
    reduced = [[matrix[i][j] + (ridge[i] if i == j else 0.0) for j in free] for i in free]
    target = [
        vector[i] + ridge[i] * prior[i] - sum(matrix[i][j] * const[j] for j in held)
        for i in free
    ]
    theta = _solve(reduced, target) if free else []
    out = const[:]
    for i, value in zip(free, theta, strict=True):
        out[i] = value
    return out


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the ridge keeps the matrix regular)."""
    n = len(vector)
    a = [[*row, b] for row, b in zip(matrix, vector, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            ratio = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= ratio * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out
