"""The endpoint pool: replicas, what is known of their load, and the gateway's own counts.

Scorers never see mutable state: the scheduler takes an immutable :class:`EndpointSnapshot` of
each candidate per request. The gateway counts its in-flight requests and the prefill work it
has sent that has not produced a first byte yet *at pick time*, so that a burst arriving between
two metric scrapes spreads out instead of herding onto the endpoint that looked idlest.

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple
from urllib.parse import urlsplit

from router.core.lease import Lease
from router.core.slots import SlotLimit, fleet_limits

log = logging.getLogger("prefixgate.endpoints")

Role = Literal["both", "prefill", "decode"]
# The load other gateway processes put on an endpoint, added to a snapshot: requests in flight,
# prefill tokens and requests queued, and the recent average of those tokens.
RemoteLoad = tuple[int, int, int, float]
NO_REMOTE_LOAD: RemoteLoad = (0, 0, 0, 0.0)

# Time constant of the queue average: about one agent turn (an answer plus a think gap), so the
# average remembers the queue a session's replica kept while the session was away.
QUEUE_AVERAGE_S = 5.0


def endpoint_id_from_url(url: str) -> str:
    """``host:port`` as llm-d names endpoints in ``x-gateway-destination-endpoint``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint url must be http(s)://host:port, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: str
    url: str
    role: Role = "both"
    models: frozenset[str] = frozenset()

    @classmethod
    def from_url(cls, url: str, role: Role = "both", models: Iterable[str] = ()) -> Endpoint:
        return cls(endpoint_id_from_url(url), url.rstrip("/"), role, frozenset(models))


@dataclass(slots=True)
class EngineMetrics:
    """The vLLM gauges a router scrapes; ``scraped_at`` is monotonic, 0 = never."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    scraped_at: float = 0.0
    # The gateways' requests in flight to the endpoint while the scrape ran (the most seen: this
    # replica's, plus the others' shared through Redis): the engine counted them in ``waiting``
    # or ``running``, even if they have finished since.
    gateway_in_flight: int = 0
    # This gateway's requests' KV claims (Lease.kv_tokens) in flight while the scrape ran (the
    # most seen): the part of ``kv_usage`` they may account for, even if they have ended since.
    gateway_kv_tokens: int = 0


NO_SESSIONS: Mapping[str, list[int]] = MappingProxyType({})


class EndpointSnapshot(NamedTuple):
    """What a scorer knows of one candidate endpoint for one request.

    A named tuple rather than a frozen dataclass: as immutable, and built in a third of the
    time (a frozen dataclass sets each field through ``object.__setattr__``); the request path
    builds one per candidate, twice a request."""

    id: str
    url: str
    role: Role
    in_flight: int
    pending_prefill_tokens: int
    waiting: float
    running: float
    kv_usage: float
    metrics_age: float
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # Requests this gateway sent that have not produced a first byte: the queue length that
    # pending_prefill_tokens is the work of.
    pending_prefill_requests: int = 0
    # pending_prefill_tokens averaged over the last QUEUE_AVERAGE_S (exponentially).
    recent_prefill_tokens: float = 0.0
    # The gateway's in-flight requests when ``waiting`` was scraped (EngineMetrics).
    scraped_in_flight: int = 0
    # The engine's learned sequence-slot limit (0: unknown) and how long a request holds a
    # slot there (router/core/slots.py).
    slot_limit: int = 0
    slot_hold_s: float = 0.0
    # The KV cache this gateway's requests in flight there hold (their kv_claim tokens), the
    # same at the last scrape (EngineMetrics.gateway_kv_tokens), and how long a request holds
    # its place there (router/core/slots.py), known limit or not.
    in_flight_kv_tokens: int = 0
    scraped_kv_tokens: int = 0
    hold_s: float = 0.0
    # session -> [its requests in flight there, the KV they hold] (EndpointState.session_kv,
    # not a copy: read while scoring, which does not yield to the event loop).
    session_kv: Mapping[str, list[int]] = NO_SESSIONS

    @property
    def foreign_waiting(self) -> float:
        """Requests waiting in the engine that no gateway request accounts for.

        Gateway requests may be among the scraped ``waiting``: those in flight now, and those in
        flight at the scrape that have finished since (a scrape is up to an interval stale).
        """
        return max(0.0, self.waiting - max(self.in_flight, self.scraped_in_flight))


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    models: set[str] = field(default_factory=set)
    healthy: bool = False
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    in_flight: int = 0
    # KV held by this gateway's requests in flight (Lease.kv_tokens): a session's requests
    # in flight at once (sub-agents forked from one context) share their context, so a
    # session counts once, at its largest claim: session -> [requests, largest claim].
    in_flight_kv_tokens: int = 0
    session_kv: dict[str, list[int]] = field(default_factory=dict)
    pending_prefill_tokens: int = 0
    pending_prefill_requests: int = 0
    # In-flight requests past their first byte as far as headers go only (ext_proc).
    headers_only: int = 0
    queue_average: float = 0.0
    queue_average_at: float = 0.0
    consecutive_failures: int = 0
    # Passive health: failures in a row of real requests, and the ejection they caused.
    failure_streak: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    times_ejected: int = 0
    readmitted_at: float = 0.0
    slots: SlotLimit = field(default_factory=SlotLimit)

    def serves(self, model: str) -> bool:
        return model in self.models or model in self.endpoint.models

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.ejected

    def recent_prefill_tokens(self, now: float) -> float:
        # pending_prefill_tokens is a step function, so this is the exact continuous average.
        pending = self.pending_prefill_tokens
        elapsed = now - self.queue_average_at
        if elapsed <= 0:
            return self.queue_average
        return pending + (self.queue_average - pending) * math.exp(-elapsed / QUEUE_AVERAGE_S)

    def hold_kv(self, tokens: int, session: str | None) -> None:
        if session is None:
            self.in_flight_kv_tokens += tokens
            return
        held = self.session_kv.get(session)
        if held is None:
            self.session_kv[session] = [1, tokens]
            self.in_flight_kv_tokens += tokens
            return
        held[0] += 1
        if tokens > held[1]:
            self.in_flight_kv_tokens += tokens - held[1]
            held[1] = tokens

    def free_kv(self, tokens: int, session: str | None) -> None:
        if session is None:
            self.in_flight_kv_tokens -= tokens
            return
        held = self.session_kv.get(session)
        if held is None:
            return
        held[0] -= 1
        if held[0] <= 0:
            self.in_flight_kv_tokens -= held[1]
            del self.session_kv[session]

    def add_pending(self, tokens: int, requests: int, now: float) -> None:
        self.queue_average = self.recent_prefill_tokens(now)
        self.queue_average_at = now
        self.pending_prefill_tokens += tokens
        self.pending_prefill_requests += requests

    def snapshot(
        self, now: float, remote: RemoteLoad = NO_REMOTE_LOAD, fleet_slots: int = 0
    ) -> EndpointSnapshot:
        m = self.metrics
        age = now - m.scraped_at if m.scraped_at else float("inf")
        in_flight, tokens, requests, recent = remote
        endpoint = self.endpoint
        slots = self.slots
        limit = slots.limit_at(now, fleet_slots)
        hold = slots.hold(now)
        return EndpointSnapshot(
            endpoint.id,
            endpoint.url,
            endpoint.role,
            self.in_flight + in_flight,
            self.pending_prefill_tokens + tokens,
            m.waiting,
            m.running,
            m.kv_usage,
            age,
            m.block_size,
            m.num_gpu_blocks,
            self.pending_prefill_requests + requests,
            self.recent_prefill_tokens(now) + recent,
            m.gateway_in_flight,
            limit,
            hold if limit else 0.0,
            self.in_flight_kv_tokens,
            m.gateway_kv_tokens,
            hold,
            self.session_kv,
        )


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
    ) -> Lease:
        state = self._states.get(endpoint_id)
        if state is None:
            raise KeyError(endpoint_id)
        return Lease(
            state, prefill_tokens, self, on_first_byte, on_release, kv_tokens, session
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
