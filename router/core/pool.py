"""The endpoint pool: every endpoint's state by id, the leases taken on them, and passive health.

Passive health (outlier ejection, as Envoy does it): an endpoint whose requests fail N times in
a row (connect errors, timeouts, 5xx; never a client's 4xx) leaves the candidates for an
ejection time that grows with each ejection, and comes back only after the monitor's health
probe succeeds. At most a share of the pool is ejected at once, and never the last endpoint
left, so a fleet-wide blip cannot empty the pool.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from router.core.endpoints import (
    NO_REMOTE_LOAD,
    Endpoint,
    EndpointSnapshot,
    EndpointState,
    RemoteLoad,
    SharedPrefix,
)
from router.core.lease import Lease
from router.core.slots import fleet_limits

log = logging.getLogger("prefixgate.endpoints")


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """Envoy's outlier detection knobs, from ``pool.outlierDetection`` (the config holds the
    defaults; core cannot import the config models)."""

    consecutive_failures: int
    base_ejection: float
    max_ejection: float
    max_ejection_percent: float


DEPARTED_KEPT_S = 60.0


class EndpointPool:
    """All endpoints by id. Mutated only from the event loop, so no locks are needed."""

    def __init__(
        self,
        endpoints: Iterable[Endpoint] = (),
        clock: Callable[[], float] = time.monotonic,
        outliers: OutlierSettings | None = None,
    ) -> None:
        self.clock = clock
        self._outliers = outliers
        self._states: dict[str, EndpointState] = {}
        # Endpoints taken out lately but still there (not ready), with when: one back within
        # DEPARTED_KEPT_S (a readiness probe that failed once) gets its state back, its
        # requests in flight and its ejection with it, rather than coming back idle and
        # healthy. One removed for good (a pod deleted) is not kept: a new pod at its address
        # starts afresh.
        self._departed: dict[str, tuple[EndpointState, float]] = {}
        for endpoint in endpoints:
            self.add(endpoint)

    def add(self, endpoint: Endpoint) -> EndpointState:
        state = self._states.get(endpoint.id)
        if state is None:
            kept, since = self._departed.pop(endpoint.id, (None, 0.0))
            if kept is not None and self.clock() - since < DEPARTED_KEPT_S and (
                kept.endpoint == endpoint
            ):
                state = kept
                self._states[endpoint.id] = state
                if state.ejected and not self._ejections_allowed(state):
                    self.readmit(state)  # others were ejected meanwhile: within the cap
                return state
            state = EndpointState(endpoint, models=set(endpoint.models))
            self._states[endpoint.id] = state
        return state

    def remove(self, endpoint_id: str, keep: bool = False) -> EndpointState | None:
        """Take an endpoint out; ``keep``: it is still there, only not ready (see add)."""
        state = self._states.pop(endpoint_id, None)
        now = self.clock()
        self._departed = {
            e: kept for e, kept in self._departed.items() if now - kept[1] < DEPARTED_KEPT_S
        }
        self._departed.pop(endpoint_id, None)
        if state is not None and keep:
            self._departed[endpoint_id] = (state, now)
        return state

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def get(self, endpoint_id: str) -> EndpointState | None:
        return self._states.get(endpoint_id)

    def models(self) -> set[str]:
        out: set[str] = set()
        for state in self._states.values():
            out |= state.models
            out |= state.endpoint.models
        return out

    def knows_model(self, model: str) -> bool:
        return any(s.serves(model) for s in self._states.values())

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self._states.values())

    def candidates(
        self, model: str, remote: Callable[[str], RemoteLoad] | None = None
    ) -> list[EndpointSnapshot]:
        """Healthy, not ejected endpoints serving ``model``, as snapshots (with the load of
        other gateway processes from ``remote``, by endpoint id)."""
        now = self.clock()
        states = [
            s for s in self._states.values() if s.healthy and not s.ejected and s.serves(model)
        ]
        fleet = fleet_limits(((s.endpoint.role, s.slots) for s in states), now)
        if remote is None:
            return [s.snapshot(now, NO_REMOTE_LOAD, fleet.get(s.endpoint.role, 0)) for s in states]
        return [
            s.snapshot(now, remote(s.endpoint.id), fleet.get(s.endpoint.role, 0)) for s in states
        ]

    def lease(
        self,
        endpoint_id: str,
        prefill_tokens: int = 0,
        on_first_byte: Callable[[float, bool], None] | None = None,
        on_release: Callable[[], None] | None = None,
        kv_tokens: int = 0,
        session: str | None = None,
        kv_own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> Lease:
        state = self._states.get(endpoint_id)
        if state is None:
            raise KeyError(endpoint_id)
        return Lease(
            state, prefill_tokens, self, on_first_byte, on_release, kv_tokens, session, kv_own,
            shared,
        )

    # -- passive health ------------------------------------------------------------------------

    def record_failure(self, state: EndpointState) -> bool:
        """Count a failed request; eject the endpoint at the threshold when the cap allows."""
        settings = self._outliers
        if settings is None or state.ejected:
            return False
        state.failure_streak += 1
        if state.failure_streak < settings.consecutive_failures or not self._may_eject(settings):
            return False
        now = self.clock()
        # The multiplier decays by one for every base ejection time served without ejection.
        if state.times_ejected and state.readmitted_at:
            served = int((now - state.readmitted_at) / settings.base_ejection)
            state.times_ejected = max(0, state.times_ejected - served)
        state.times_ejected += 1
        duration = min(settings.base_ejection * state.times_ejected, settings.max_ejection)
        state.ejected = True
        state.ejected_until = now + duration
        log.warning(
            "endpoint %s ejected for %.1fs after %d consecutive failures",
            state.endpoint.id, duration, state.failure_streak,
        )
        return True

    def _may_eject(self, settings: OutlierSettings) -> bool:
        states = self._states.values()
        ejected = sum(1 for s in states if s.ejected)
        # Never the last eligible endpoint: a failing answer beats a certain 503.
        others = sum(1 for s in states if s.healthy and not s.ejected) - 1
        return ejected < self._ejection_cap(settings) and others > 0

    def _ejection_cap(self, settings: OutlierSettings) -> int:
        cap = math.floor(len(self._states) * settings.max_ejection_percent / 100)
        if settings.max_ejection_percent > 0:
            cap = max(1, cap)  # as Envoy: one endpoint can always be ejected
        return cap

    def _ejections_allowed(self, state: EndpointState) -> bool:
        """Whether ``state``'s ejection, back with it, keeps within the cap and leaves
        another endpoint eligible."""
        settings = self._outliers
        if settings is None:
            return True
        states = self._states.values()
        ejected = sum(1 for s in states if s.ejected)
        others = sum(1 for s in states if s is not state and s.healthy and not s.ejected)
        return ejected <= self._ejection_cap(settings) and others > 0

    def ejection_expired(self, state: EndpointState) -> bool:
        return state.ejected and self.clock() >= state.ejected_until

    def readmit(self, state: EndpointState) -> None:
        """Back in after a successful probe; one more failure ejects it again (half-open)."""
        if not state.ejected:
            return
        state.ejected = False
        state.readmitted_at = self.clock()
        threshold = self._outliers.consecutive_failures if self._outliers else 1
        state.failure_streak = threshold - 1
        log.info("endpoint %s readmitted after its ejection", state.endpoint.id)

    def extend_ejection(self, state: EndpointState) -> None:
        """The probe failed: stay out for another base ejection time."""
        base = self._outliers.base_ejection if self._outliers else 1.0
        state.ejected_until = self.clock() + base
