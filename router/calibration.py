"""Self-calibration of each endpoint's prefill cost from what the gateway observes.

At the first byte of every answer the gateway knows how long the endpoint took and how much
prefill work stood in front of it (its own uncached tokens plus the uncached tokens of requests
sent there earlier and still without a first byte). A per-endpoint robust running regression
``ttfb = overhead + per_token * tokens`` learns the two figures online: exponentially weighted
(old samples decay, so a replica that slows down is noticed), with each sample's residual
clipped (Huber), the slope pulled towards the prior's by as much as the token counts lack
spread (ridge), and the fit held to sane bounds. Until enough samples exist the priors (an 8B
model on one H100) are blended in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge


@dataclass(frozen=True, slots=True)
class CostPriors:
    overhead_s: float = 0.030
    per_token_s: float = 0.0002
    # Samples before the fit is trusted fully; until then it is blended with the priors.
    warmup_samples: int = 20
    # Weight of the past: 0.98 forgets a sample's influence with a half-life of ~35 samples.
    decay: float = 0.98
    # Residuals beyond this many seconds count as this many (a stall, a GC pause, a preemption).
    clip_s: float = 1.0
    # Strength of the prior slope, as the spread (standard deviation, tokens) of token counts
    # at which the samples weigh as much as the prior (ridge regression towards it). Prompts
    # of nearly one size say little about the cost of a token, and a slope fitted to their
    # noise can collapse to nothing, which would make every queued or running token free on
    # that endpoint and herd traffic onto it. Agentic traffic, spread over thousands of
    # tokens, overrides the prior almost entirely (it keeps 1% of the weight at a spread of
    # 1,000 tokens, 80% at 50).
    prior_spread_tokens: float = 100.0


@dataclass(slots=True)
class _Fit:
    # Exponentially weighted sums for least squares on y = a + b x.
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0
    overhead_s: float = 0.0
    per_token_s: float = 0.0


class Calibrator:
    """Learned (overhead, per-token) prefill cost per endpoint; read by the cost scorer."""

    def __init__(self, priors: CostPriors | None = None, registry: CollectorRegistry | None = None):
        self.priors = priors or CostPriors()
        self._fits: dict[str, _Fit] = {}
        self._overhead: Gauge | None = None
        self._per_token: Gauge | None = None
        if registry is not None:
            self._overhead = Gauge(
                "prefixgate_calibrated_prefill_overhead_seconds",
                "Learned fixed cost of a request's first token on each endpoint.",
                ["endpoint"],
                registry=registry,
            )
            self._per_token = Gauge(
                "prefixgate_calibrated_prefill_seconds_per_token",
                "Learned prefill time per uncached prompt token on each endpoint.",
                ["endpoint"],
                registry=registry,
            )

    def cost(self, endpoint_id: str) -> tuple[float, float]:
        """(overhead seconds, seconds per token) for the endpoint: learned, or the priors."""
        fit = self._fits.get(endpoint_id)
        p = self.priors
        if fit is None or fit.samples == 0:
            return p.overhead_s, p.per_token_s
        trust = min(1.0, fit.samples / p.warmup_samples)
        return (
            trust * fit.overhead_s + (1 - trust) * p.overhead_s,
            trust * fit.per_token_s + (1 - trust) * p.per_token_s,
        )

    def predict(self, endpoint_id: str, tokens: float) -> float:
        overhead, per_token = self.cost(endpoint_id)
        return overhead + per_token * tokens

    def observe(self, endpoint_id: str, tokens: float, seconds: float) -> None:
        """One first byte: ``seconds`` after sending, with ``tokens`` of prefill ahead of it."""
        if not (math.isfinite(tokens) and math.isfinite(seconds)) or seconds < 0 or tokens < 0:
            return
        fit = self._fits.setdefault(endpoint_id, _Fit())
        p = self.priors
        predicted = self.predict(endpoint_id, tokens)
        residual = max(-p.clip_s, min(p.clip_s, seconds - predicted))
        y = predicted + residual
        d = p.decay
        fit.w = fit.w * d + 1.0
        fit.sx = fit.sx * d + tokens
        fit.sy = fit.sy * d + y
        fit.sxx = fit.sxx * d + tokens * tokens
        fit.sxy = fit.sxy * d + tokens * y
        fit.samples += 1
        self._solve(fit)
        if self._overhead is not None and self._per_token is not None:
            overhead, per_token = self.cost(endpoint_id)
            self._overhead.labels(endpoint_id).set(overhead)
            self._per_token.labels(endpoint_id).set(per_token)

    def _solve(self, fit: _Fit) -> None:
        p = self.priors
        mean_x, mean_y = fit.sx / fit.w, fit.sy / fit.w
        var_x = max(0.0, fit.sxx / fit.w - mean_x * mean_x)
        cov_xy = fit.sxy / fit.w - mean_x * mean_y
        # Ridge towards the prior slope: without spread in the token counts the slope is not
        # identifiable and stays the prior's, while the intercept is learned either way.
        ridge = max(p.prior_spread_tokens, 1.0) ** 2
        slope = (cov_xy + ridge * p.per_token_s) / (var_x + ridge)
        # Sane bounds: a token never costs less than a hundredth or more than 100x the prior.
        slope = min(max(slope, p.per_token_s / 100), p.per_token_s * 100)
        fit.per_token_s = slope
        fit.overhead_s = min(max(mean_y - slope * mean_x, 0.0), 60.0)

    def forget(self, endpoint_id: str) -> None:
        self._fits.pop(endpoint_id, None)
