"""The endpoint pool: replicas, what is known of their load, and the gateway's own counts.

Scorers never see mutable state: the scheduler takes an immutable :class:`EndpointSnapshot` of
each candidate per request. The gateway counts its in-flight requests and the prefill work it
has sent that has not produced a first byte yet *at pick time*, so that a burst arriving between
two metric scrapes spreads out instead of herding onto the endpoint that looked idlest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

Role = Literal["both", "prefill", "decode"]


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


@dataclass(frozen=True, slots=True)
class EndpointSnapshot:
    """What a scorer knows of one candidate endpoint for one request."""

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


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    models: set[str] = field(default_factory=set)
    healthy: bool = False
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    consecutive_failures: int = 0

    def serves(self, model: str) -> bool:
        return model in self.models or model in self.endpoint.models

    def snapshot(self, now: float) -> EndpointSnapshot:
        m = self.metrics
        age = now - m.scraped_at if m.scraped_at else float("inf")
        return EndpointSnapshot(
            id=self.endpoint.id,
            url=self.endpoint.url,
            role=self.endpoint.role,
            in_flight=self.in_flight,
            pending_prefill_tokens=self.pending_prefill_tokens,
            waiting=m.waiting,
            running=m.running,
            kv_usage=m.kv_usage,
            metrics_age=age,
            block_size=m.block_size,
            num_gpu_blocks=m.num_gpu_blocks,
        )


class Lease:
    """One request's claim on an endpoint: counted in-flight until released, exactly once."""

    __slots__ = ("_first_byte_seen", "_released", "prefill_tokens", "state")

    def __init__(self, state: EndpointState, prefill_tokens: int) -> None:
        self.state = state
        self.prefill_tokens = prefill_tokens
        self._first_byte_seen = False
        self._released = False
        state.in_flight += 1
        state.pending_prefill_tokens += prefill_tokens

    def first_byte(self) -> None:
        if not self._first_byte_seen:
            self._first_byte_seen = True
            self.state.pending_prefill_tokens -= self.prefill_tokens

    def release(self) -> None:
        if self._released:
            return
        self.first_byte()
        self._released = True
        self.state.in_flight -= 1


class EndpointPool:
    """All endpoints by id. Mutated only from the event loop, so no locks are needed."""

    def __init__(
        self, endpoints: Iterable[Endpoint] = (), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._states: dict[str, EndpointState] = {}
        for endpoint in endpoints:
            self.add(endpoint)

    def add(self, endpoint: Endpoint) -> EndpointState:
        state = self._states.get(endpoint.id)
        if state is None:
            state = EndpointState(endpoint, models=set(endpoint.models))
            self._states[endpoint.id] = state
        return state

    def remove(self, endpoint_id: str) -> EndpointState | None:
        return self._states.pop(endpoint_id, None)

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

    def candidates(self, model: str) -> list[EndpointSnapshot]:
        """Healthy endpoints serving ``model``, as snapshots."""
        now = self._clock()
        return [s.snapshot(now) for s in self._states.values() if s.healthy and s.serves(model)]

    def lease(self, endpoint_id: str, prefill_tokens: int = 0) -> Lease:
        state = self._states.get(endpoint_id)
        if state is None:
            raise KeyError(endpoint_id)
        return Lease(state, prefill_tokens)
