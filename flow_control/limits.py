"""Per-endpoint concurrency limits learned from the gateway's own first bytes.

A gradient controller in the spirit of Envoy's adaptive concurrency filter and Netflix's
concurrency-limits, with two changes for LLM replicas: what is limited is the number of this
gateway's requests still waiting for their first byte on an endpoint (its prefill queue; a
decoding request hardly slows a new one), and what is compared is not raw latency but each
first byte's time over the time the calibrator predicts for the same prompt on an idle
endpoint, since prompt sizes differ by 1000x. Nothing here reads scraped metrics: the
detector uses them only to lower an endpoint's room by the queue other clients keep there.
See docs/flow-control.md for the rules and their reasons.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from flow_control.config import ConcurrencyLimitConfig
from router.core.endpoints import EndpointSnapshot

# How fast the baseline (the lowest latency ratio seen) drifts up per sample taken with no queue
# of ours, so that a baseline set by one lucky sample, or by a replica that has since slowed,
# is forgotten.
_BASELINE_DRIFT = 1.01
# Weight of each sample in the smoothed ratio.
_SMOOTHING = 0.2
# At most this share of the limit is cut per sample, however bad the sample.
_MAX_CUT = 0.1


@dataclass(slots=True)
class _Limit:
    limit: float
    baseline: float = math.inf
    smoothed: float = 0.0
    samples: int = 0


class ConcurrencyLimits:
    """The learned limits, one per endpoint; mutated on the event loop only."""

    def __init__(self, config: ConcurrencyLimitConfig) -> None:
        self._config = config
        self._limits: dict[str, _Limit] = {}

    def limit(self, endpoint_id: str) -> int:
        state = self._limits.get(endpoint_id)
        return int(state.limit) if state is not None else self._config.initial_limit

    def observe(self, endpoint_id: str, ratio: float, queued_at_send: int) -> bool:
        """One first byte: ``ratio`` = its time over the idle prediction; ``queued_at_send``
        = the requests waiting for a first byte there when it was sent (every gateway's, as
        the room counts them).

        Returns True when the limit grew (queued work may now be dispatched)."""
        if not math.isfinite(ratio) or ratio <= 0:
            return False
        cfg = self._config
        state = self._limits.get(endpoint_id)
        if state is None:
            state = self._limits[endpoint_id] = _Limit(float(cfg.initial_limit))
        state.samples += 1
        # The baseline is what a request meets with no queue of ours ahead of it, so only
        # such samples may move it up; under sustained load it must not drift to the load.
        # A first byte much faster than the idle prediction hit a cache the index did not know
        # of (or the calibrator has yet to learn the endpoint's speed): it says nothing of the
        # queue, and as the baseline it would cut every normal sample after it. Below
        # 1/tolerance it counts as 1/tolerance: no cut while first bytes keep to the idle
        # prediction.
        drift = _BASELINE_DRIFT if queued_at_send == 0 else 1.0
        floor = 1.0 / cfg.tolerance
        state.baseline = min(max(ratio, floor), state.baseline * drift)
        state.smoothed = ratio if state.samples == 1 else (
            state.smoothed + _SMOOTHING * (ratio - state.smoothed)
        )
        gradient = cfg.tolerance * state.baseline / state.smoothed
        if gradient < 1.0:
            cut = _MAX_CUT * min(1.0, 2.0 * (1.0 - gradient))
            state.limit = max(float(cfg.min_limit), state.limit * (1.0 - cut))
            return False
        # Grow only when the limit was what bound: an unused limit proves nothing. The room is
        # its whole part (a cut leaves a fraction), so that is what a request sent at it met.
        if queued_at_send + 1 >= int(state.limit) and state.limit < cfg.max_limit:
            state.limit = min(float(cfg.max_limit), state.limit + 1.0)
            return True
        return False

    def forget(self, endpoint_id: str) -> None:
        self._limits.pop(endpoint_id, None)

    def items(self) -> Iterator[tuple[str, int]]:
        for endpoint_id, state in self._limits.items():
            yield endpoint_id, int(state.limit)


class ConcurrencySaturationDetector:
    """The pool is saturated when every endpoint has its limit of requests waiting for a
    first byte, less the queue that other clients keep there (a soft input from the scrape).

    Liveness: an endpoint with nothing of this gateway's in flight always has room for one,
    whatever its metrics say, so requests are never held by readings alone."""

    def __init__(self, limits: ConcurrencyLimits, staleness: float) -> None:
        self.limits = limits
        self._staleness = staleness

    def room(self, endpoint: EndpointSnapshot) -> int:
        limit = self.limits.limit(endpoint.id)
        if endpoint.metrics_age <= self._staleness:
            limit -= int(endpoint.foreign_waiting)
        room = max(1, limit) - endpoint.pending_prefill_requests
        if endpoint.in_flight == 0:
            room = max(room, 1)
        return max(0, room)

    def saturated(self, endpoints: Sequence[EndpointSnapshot], pending: int = 0) -> bool:
        room = 0
        for endpoint in endpoints:
            room += self.room(endpoint)
            if room > pending:
                return False
        return True
