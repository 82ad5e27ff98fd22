"""Self-calibration of each endpoint's prefill cost from what the gateway observes.

At the first byte of every answer the gateway knows how long the endpoint took and how much
prefill work stood in front of it (its own uncached tokens plus the uncached tokens of requests
sent there earlier and still without a first byte). A robust running regression
``ttfb = overhead + per_token * tokens`` learns the two figures online: exponentially weighted
(old samples decay, so a replica that slows down is noticed), with each sample's residual
clipped (Huber), the slope pulled towards the prior's by as much as the token counts
lack spread (ridge), and the fit held to sane bounds.

Two levels, because one endpoint's samples are few and biased by the moment they were
taken. Fitted alone, a replica that served a burst at a cold start learned a huge overhead from
requests that waited for each other, was priced out, and so never got the traffic that would
have corrected it; and busy replicas, whose samples lie further out on the token axis, learned
flatter slopes than idle ones and so looked cheaper for long prompts, which made them busier.
So the *fleet* fit (every sample, starting from an 8B-on-H100 prior) gives the shape, and each
endpoint only a speed factor against it: its decayed sum of observed times over the sum the
fleet's current fit predicts for the same samples (a replica on slower hardware is slower at
every prompt length). The factor is shrunk towards 1 by the endpoint's evidence (``w / (w +
pseudo)`` in log space, ``w`` its decayed sample weight, halved for every
``stale_half_life_s`` since its last sample). Replicas of one model on one kind of hardware
are priced alike, a truly slower one stays slower, a new replica starts from what the fleet
has learned rather than from the prior, and one priced out by an unlucky start drifts back to
the fleet's figures and gets traffic again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric


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
    # Strength of the prior slope, as the spread (standard deviation, tokens) of token counts
    # at which the samples weigh as much as the prior (ridge regression towards it). Prompts
    # of nearly one size say little about the cost of a token, and a slope fitted to their
    # noise can collapse to nothing, which would make every queued or running token free and
    # herd traffic. Agentic traffic, spread over thousands of tokens, overrides the prior
    # almost entirely (it keeps 1% of the weight at a spread of 1,000 tokens, 80% at 50).
    prior_spread_tokens: float = 100.0
    # An endpoint's speed factor counts w / (w + this) of its own evidence (in log space; w:
    # its decayed sample weight, at most 1 / (1 - endpoint_decay) = 50, so at most ~83%).
    endpoint_pseudo_samples: float = 10.0
    # An endpoint's evidence halves for every this many seconds without a sample of its own.
    stale_half_life_s: float = 30.0


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

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + y
        self.sxx = self.sxx * decay + x * x
        self.sxy = self.sxy * decay + x * y
        self.samples += 1

    def solve(self, priors: CostPriors) -> None:
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var_x = max(0.0, self.sxx / self.w - mean_x * mean_x)
        cov_xy = self.sxy / self.w - mean_x * mean_y
        # Ridge towards the prior slope: without spread in the token counts the slope is not
        # identifiable and stays the prior's, while the intercept is learned either way.
        ridge = max(priors.prior_spread_tokens, 1.0) ** 2
        slope = (cov_xy + ridge * priors.per_token_s) / (var_x + ridge)
        # Sane bounds: a token never costs less than a hundredth or more than 100x the prior.
        slope = min(max(slope, priors.per_token_s / 100), priors.per_token_s * 100)
        self.per_token_s = slope
        self.overhead_s = min(max(mean_y - slope * mean_x, 0.0), 60.0)


@dataclass(slots=True)
class _Speed:
    """One endpoint's decayed sums of prefill tokens and (clipped) first-byte times."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    last_sample: float = 0.0


class Calibrator:
    """Learned (overhead, per-token) prefill cost per endpoint; read by the cost scorer."""

    def __init__(
        self,
        priors: CostPriors | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.priors = priors or CostPriors()
        self._clock = clock
        self._fleet = _Fit()
        self._speeds: dict[str, _Speed] = {}
        if registry is not None:
            registry.register(self)

    def fleet_cost(self) -> tuple[float, float]:
        """(overhead seconds, seconds per token) learned over every endpoint, or the priors."""
        p = self.priors
        fleet = self._fleet
        trust = min(1.0, fleet.samples / p.warmup_samples)
        return (
            trust * fleet.overhead_s + (1 - trust) * p.overhead_s,
            trust * fleet.per_token_s + (1 - trust) * p.per_token_s,
        )

    def factor(self, endpoint_id: str) -> float:
        """How much slower than the fleet the endpoint is (shrunk towards 1 by its evidence)."""
        return self._factor(endpoint_id, self.fleet_cost())

    def _factor(self, endpoint_id: str, fleet: tuple[float, float]) -> float:
        speed = self._speeds.get(endpoint_id)
        if speed is None or speed.w <= 0:
            return 1.0
        predicted = fleet[0] * speed.w + fleet[1] * speed.sx
        if predicted <= 0 or speed.sy <= 0:
            return 1.0
        p = self.priors
        ratio = min(max(speed.sy / predicted, 0.1), 10.0)
        age = max(0.0, self._clock() - speed.last_sample)
        weight = speed.w * 0.5 ** (age / p.stale_half_life_s)
        return float(ratio ** (weight / (weight + p.endpoint_pseudo_samples)))

    def cost(self, endpoint_id: str) -> tuple[float, float]:
        """(overhead seconds, seconds per token) for the endpoint: the fleet's, times its
        speed factor."""
        overhead, per_token = fleet = self.fleet_cost()
        factor = self._factor(endpoint_id, fleet)
        return overhead * factor, per_token * factor

    def predict(self, endpoint_id: str, tokens: float) -> float:
        overhead, per_token = self.cost(endpoint_id)
        return overhead + per_token * tokens

    def observe(self, endpoint_id: str, tokens: float, seconds: float) -> None:
        """One first byte: ``seconds`` after sending, with ``tokens`` of prefill ahead of it."""
        if not (math.isfinite(tokens) and math.isfinite(seconds)) or seconds < 0 or tokens < 0:
            return
        p = self.priors
        overhead, per_token = self.fleet_cost()
        self._fleet.add(tokens, self._clipped(overhead + per_token * tokens, seconds), p.decay)
        self._fleet.solve(p)
        y = self._clipped(self.predict(endpoint_id, tokens), seconds)
        speed = self._speeds.setdefault(endpoint_id, _Speed())
        d = p.endpoint_decay
        speed.w, speed.sx, speed.sy = speed.w * d + 1.0, speed.sx * d + tokens, speed.sy * d + y
        speed.last_sample = self._clock()

    def _clipped(self, predicted: float, seconds: float) -> float:
        """The observation with its residual clipped (Huber) to clip_s or the prediction,
        whichever is larger: one stall must not wreck the fit, yet a replica ten times slower
        than predicted is learned in tens of samples, not hundreds."""
        clip = max(self.priors.clip_s, predicted)
        return predicted + max(-clip, min(clip, seconds - predicted))

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint's factor (it left the pool); what the fleet learned from it stays."""
        self._speeds.pop(endpoint_id, None)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        self.forget(endpoint_id)

    def collect(self) -> Iterator[Metric]:
        overhead = GaugeMetricFamily(
            "prefixgate_calibrated_prefill_overhead_seconds",
            "Learned fixed cost of a request's first token on each endpoint.",
            labels=["endpoint"],
        )
        per_token = GaugeMetricFamily(
            "prefixgate_calibrated_prefill_seconds_per_token",
            "Learned prefill time per uncached prompt token on each endpoint.",
            labels=["endpoint"],
        )
        for endpoint_id in list(self._speeds):
            a, b = self.cost(endpoint_id)
            overhead.add_metric([endpoint_id], a)
            per_token.add_metric([endpoint_id], b)
        yield overhead
        yield per_token
        a, b = self.fleet_cost()
        yield GaugeMetricFamily(
            "prefixgate_calibrated_fleet_prefill_overhead_seconds",
            "Learned fixed cost of a first token over all endpoints (new endpoints start here).",
            value=a,
        )
        yield GaugeMetricFamily(
            "prefixgate_calibrated_fleet_prefill_seconds_per_token",
            "Learned prefill time per uncached prompt token over all endpoints.",
            value=b,
        )
