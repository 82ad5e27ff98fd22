"""Self-calibration of each endpoint's first-byte cost from what the gateway observes.

At every answer's first byte the gateway knows how long the endpoint took and what stood in
front of it (its own uncached tokens, the queued ones, the running requests), so the prices of
the cost model are learned online rather than configured: a robust, exponentially weighted
regression pulled towards vLLM-shaped priors. Two levels, because one endpoint's samples are
few and biased by the moment they were taken: a fleet fit gives the shape, each endpoint only a
speed factor against it. The model and why: docs/routing.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from router.estimators.cost_fit import CostFit
from router.estimators.cost_fit import CostPriors as CostPriors

# The fit is re-solved at most this often, or once this many samples came in (a solve is tens
# of microseconds of Python; once per first byte it was a tenth of the gateway's CPU at a few
# thousand requests a second, while the fit moves over tens of samples).
REFIT_INTERVAL_S = 0.05
REFIT_SAMPLES = 16
# An endpoint's price is kept this long while neither the fleet's price nor the endpoint's own
# samples change: all that moves it meanwhile is the staleness decay of its speed factor
# (half-life ``stale_half_life_s``, 30 s), and the scorer reads it for every candidate.
PRICE_TTL_S = 0.5
_MAX_COUNT = 1e9


@dataclass(frozen=True, slots=True)
class Price:
    """What one endpoint's first byte costs: the learned figures, times its speed factor."""

    overhead_s: float
    per_token_s: float
    # What a token of the queue ahead costs.
    per_queued_token_s: float
    per_running_s: float
    # What each request queued ahead costs beyond its tokens.
    per_queued_request_s: float = 0.0

    def predict(
        self, own: float, queued: float = 0.0, running: float = 0.0, queued_requests: float = 0.0
    ) -> float:
        return (
            self.overhead_s + self.per_token_s * own + self.per_queued_token_s * queued
            + self.per_running_s * running + self.per_queued_request_s * queued_requests
        )

    def scaled(self, factor: float) -> Price:
        return Price(
            self.overhead_s * factor, self.per_token_s * factor,
            self.per_queued_token_s * factor, self.per_running_s * factor,
            self.per_queued_request_s * factor,
        )


@dataclass(slots=True)
class _Speed:
    """Decayed sums of own tokens, queued tokens, running requests, queued requests and
    (clipped) first-byte times, of one endpoint's samples or of all endpoints': what their
    fleet-predicted times are summed from."""

    w: float = 0.0
    sx: list[float] = field(default_factory=lambda: [0.0] * 4)
    sy: float = 0.0
    last_sample: float = 0.0
    count: int = 0  # every sample ever, undecayed: how far first bytes have outweighed a probe

    def add(
        self, counts: tuple[float, ...], y: float, decay: float, now: float, half_life_s: float
    ) -> None:
        # The past also fades with the time since the last sample, as _factor discounts it
        # while no sample comes: else the first sample after a quiet spell brought the
        # evidence of long ago back at full weight.
        if self.w > 0:
            decay *= self.fade(now, half_life_s)
        self.w, self.sy = self.w * decay + 1.0, self.sy * decay + y
        self.count += 1
        self.sx = [s * decay + v for s, v in zip(self.sx, counts, strict=True)]
        self.last_sample = now

    def fade(self, now: float, half_life_s: float) -> float:
        """How much of the evidence still counts, ``now``, since the last sample."""
        return float(0.5 ** (max(0.0, now - self.last_sample) / half_life_s))


def _ratio(speed: _Speed, fleet: Price) -> float | None:
    """Observed over ``fleet``-predicted first bytes of ``speed``'s samples (None: no basis)."""
    if speed.w <= 0 or speed.sy <= 0:
        return None
    # The counts are sums over the samples, so the overhead counts once a sample.
    predicted = fleet.predict(*speed.sx) + fleet.overhead_s * (speed.w - 1.0)
    return speed.sy / predicted if predicted > 0 else None


class Calibrator:
    """Learned first-byte cost per endpoint; read by the cost scorer."""

    def __init__(
        self,
        priors: CostPriors | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._priors = priors or CostPriors()
        self._clock = clock
        self._fleet = CostFit()
        # The fleet's price changes only with a sample or new priors; the scorers read it for
        # every candidate of every request, so it is computed when those change.
        self._fleet_price: Price | None = None
        self._unsolved = 0  # samples added to the fit since it was last solved
        self._solved_at = -math.inf
        self._speeds: dict[str, _Speed] = {}
        # Every endpoint's samples together, decayed alike: what an endpoint's speed is judged
        # against (see _factor).
        self._all = _Speed()
        # endpoint -> (the fleet price it was scaled from, when, the price)
        self._prices: dict[str, tuple[Price, float, Price]] = {}
        # endpoint -> its speed probe's time (router/pool/speed_probe.py), and their median.
        self._probes: dict[str, float] = {}
        self._probe_median = 0.0
        if registry is not None:
            registry.register(self)

    @property
    def priors(self) -> CostPriors:
        return self._priors

    @priors.setter
    def priors(self, priors: CostPriors) -> None:
        self._priors = priors
        self._fleet_price = None
        # The fit's coefficients were bounded and pulled by the old priors: solve again.
        if self._fleet.samples:
            self._unsolved = max(self._unsolved, 1)
            self._solved_at = -math.inf

    def fleet_price(self) -> Price:
        """The figures learned over every endpoint (blended with the priors while few)."""
        if self._unsolved and (
            self._unsolved >= REFIT_SAMPLES or self._clock() - self._solved_at >= REFIT_INTERVAL_S
        ):
            self._fleet.solve(self._priors)
            self._unsolved = 0
            self._solved_at = self._clock()
            self._fleet_price = None
        if self._fleet_price is None:
            self._fleet_price = self._compute_fleet_price()
        return self._fleet_price

    def _compute_fleet_price(self) -> Price:
        p = self._priors
        fleet = self._fleet
        trust = min(1.0, fleet.samples / p.warmup_samples)
        slope, queued, running, per_request = fleet.beta

        def blend(learned: float, prior: float) -> float:
            return trust * learned + (1 - trust) * prior

        # The queued and running prices keep their learned difference from the own-token slope
        # while it is blended with the prior's.
        per_token = blend(slope, p.per_token_s)
        per_running = per_token * p.running_tokens + trust * (running - slope * p.running_tokens)
        return Price(
            blend(fleet.overhead_s, p.overhead_s), per_token,
            per_token + trust * (queued - slope), per_running, trust * per_request,
        )

    def fleet_cost(self) -> tuple[float, float]:
        """(overhead seconds, seconds per token) learned over every endpoint, or the priors."""
        price = self.fleet_price()
        return price.overhead_s, price.per_token_s

    def factor(self, endpoint_id: str) -> float:
        """How much slower than the fleet the endpoint is (shrunk towards its speed probe's
        prior, or 1 without one, by its evidence)."""
        return self._factor(endpoint_id, self.fleet_price())

    def probed(self, endpoint_id: str, seconds: float) -> None:
        """The endpoint's speed probe took ``seconds`` (the fastest of its tiny requests, sent
        while it took no traffic of this gateway's): its time against the median of every
        probed endpoint's is the speed factor's prior, where traffic has not told it yet."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self._probes[endpoint_id] = seconds
        self._probes_changed()

    def _probes_changed(self) -> None:
        self._probe_median = statistics.median(self._probes.values()) if self._probes else 0.0
        self._prices.clear()

    def _prior(self, endpoint_id: str) -> float:
        """The speed factor before any first byte: the probe's ratio to the fleet's median (a
        lone probe compares with nothing: 1)."""
        probe = self._probes.get(endpoint_id)
        if probe is None or len(self._probes) < 2:
            return 1.0
        return min(max(probe / self._probe_median, 0.1), 10.0)

    def _factor(self, endpoint_id: str, fleet: Price) -> float:
        prior = self._prior(endpoint_id)
        speed = self._speeds.get(endpoint_id)
        if speed is None or speed.w <= 0:
            return prior
        ratio = _ratio(speed, fleet)
        if ratio is None:
            return prior
        p = self.priors
        if self._fleet.samples < p.warmup_samples:
            # While the fleet price still leans on the priors, an endpoint is judged against the
            # other endpoints' samples, not that price: with the priors off, every endpoint
            # with samples looked faster (or slower) than those without, and took (or lost)
            # every request that found its prefix nowhere, so one replica filled with every
            # new prefix while the others stood empty.
            ratio /= _ratio(self._all, fleet) or ratio  # the fleet's sums hold this one's
        ratio = min(max(ratio, 0.1), 10.0)
        k = p.endpoint_pseudo_samples
        weight = speed.w * speed.fade(self._clock(), p.stale_half_life_s)
        own = weight / (weight + k)
        # Shrunk towards the prior by the pseudo-samples; the probe's prior itself fades as
        # first bytes come (one probe met in a stall must not bias the endpoint for good).
        prior **= k / (k + speed.count)
        return float(ratio**own * prior ** (1.0 - own))

    def price(self, endpoint_id: str) -> Price:
        """The endpoint's figures: the fleet's, times its speed factor."""
        fleet = self.fleet_price()
        now = self._clock()
        cached = self._prices.get(endpoint_id)
        if cached is not None and cached[0] is fleet and now - cached[1] < PRICE_TTL_S:
            return cached[2]
        price = self._price(endpoint_id, fleet)
        self._prices[endpoint_id] = (fleet, now, price)
        return price

    def _price(self, endpoint_id: str, fleet: Price) -> Price:
        return fleet.scaled(self._factor(endpoint_id, fleet))

    def cost(self, endpoint_id: str) -> tuple[float, float]:
        """(overhead seconds, seconds per token) for the endpoint."""
        price = self.price(endpoint_id)
        return price.overhead_s, price.per_token_s

    def predict(
        self,
        endpoint_id: str,
        tokens: float,
        queued: float = 0.0,
        running: float = 0.0,
        queued_requests: float = 0.0,
    ) -> float:
        return self.price(endpoint_id).predict(tokens, queued, running, queued_requests)

    def observe(
        self,
        endpoint_id: str,
        tokens: float,
        seconds: float,
        queued: float = 0.0,
        running: float = 0.0,
        queued_requests: float = 0.0,
    ) -> None:
        """One first byte: ``seconds`` after sending, with ``tokens`` of the request's own
        prefill, ``queued`` tokens of prefill ahead of it in ``queued_requests`` requests, and
        ``running`` requests beside it."""
        counts = (tokens, queued, running, queued_requests)
        # Counts beyond any engine's (a corrupt usage) would overflow the fit's sums for good.
        if not all(math.isfinite(v) and 0 <= v < _MAX_COUNT for v in (*counts, seconds)):
            return
        p = self.priors
        fleet = self.fleet_price()
        self._fleet.add(counts, self._clipped(fleet.predict(*counts), seconds), p.decay)
        self._unsolved += 1  # solved when next read (fleet_price)
        # The endpoint's speed is judged against the prediction made before this sample.
        own = self._price(endpoint_id, fleet)
        y = self._clipped(own.predict(*counts), seconds)
        speed = self._speeds.setdefault(endpoint_id, _Speed())
        now = self._clock()
        for sums in (speed, self._all):
            sums.add(counts, y, p.endpoint_decay, now, p.stale_half_life_s)
        self._prices.pop(endpoint_id, None)

    def _clipped(self, predicted: float, seconds: float) -> float:
        """The observation with its residual clipped (Huber) to clip_s or the prediction,
        whichever is larger: one stall must not wreck the fit, yet a replica ten times slower
        than predicted is learned in tens of samples, not hundreds."""
        clip = max(self.priors.clip_s, predicted)
        return predicted + max(-clip, min(clip, seconds - predicted))

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint's factor (it left the pool); what the fleet learned from it stays."""
        self._speeds.pop(endpoint_id, None)
        self._prices.pop(endpoint_id, None)
        if self._probes.pop(endpoint_id, None) is not None:
            self._probes_changed()

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
        probes = GaugeMetricFamily(
            "prefixgate_speed_probe_seconds",
            "Fastest of the speed probe's tiny completions on each endpoint (its speed prior).",
            labels=["endpoint"],
        )
        for endpoint_id, seconds in list(self._probes.items()):
            probes.add_metric([endpoint_id], seconds)
        yield overhead
        yield per_token
        yield probes
        fleet = self.fleet_price()
        for name, text, value in (
            ("prefill_overhead_seconds", "fixed cost of a first token", fleet.overhead_s),
            ("prefill_seconds_per_token", "prefill time per uncached prompt token",
             fleet.per_token_s),
            ("prefill_seconds_per_queued_token",
             "delay per uncached token of the requests queued ahead", fleet.per_queued_token_s),
            ("prefill_seconds_per_running_request",
             "first-byte delay per request running on the endpoint", fleet.per_running_s),
            ("prefill_seconds_per_queued_request",
             "delay per request queued ahead, beyond its tokens", fleet.per_queued_request_s),
        ):
            yield GaugeMetricFamily(
                f"prefixgate_calibrated_fleet_{name}",
                f"Learned {text}, over all endpoints (new endpoints start here).",
                value=value,
            )
