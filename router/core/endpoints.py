"""Endpoints: replicas, what is known of their load, and the gateway's own counts.

Scorers never see mutable state: the scheduler takes an immutable :class:`EndpointSnapshot` of
each candidate per request. The gateway counts its in-flight requests and the prefill work it
has sent that has not produced a first byte yet *at pick time*, so that a burst arriving between
two metric scrapes spreads out instead of herding onto the endpoint that looked idlest. The
pool of them is router.core.pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple
from urllib.parse import urlsplit

from router.core.slots import SlotLimit

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
    # When the engine started (epoch seconds, 0 = unknown): its life, the same for every
    # gateway that scrapes it, so a restart is told apart from the next one.
    engine_started: float = 0.0
    scraped_at: float = 0.0
    # The gateways' requests in flight to the endpoint while the scrape ran (the most seen: this
    # replica's, plus the others' shared through Redis): the engine counted them in ``waiting``
    # or ``running``, even if they have finished since.
    gateway_in_flight: int = 0
    # This gateway's requests' KV claims (Lease.kv_tokens) in flight while the scrape ran (the
    # most seen): the part of ``kv_usage`` they may account for, even if they have ended since.
    gateway_kv_tokens: int = 0


NO_SESSIONS: Mapping[str, list[int]] = MappingProxyType({})
NO_PREFIXES: Mapping[int, list[int]] = MappingProxyType({})


class SharedPrefix(NamedTuple):
    """The leading part of a session's prompts that other sessions share (an agent type's
    system prompt and tools): ``tokens`` of them, named by ``key``, the hash of the prefix's
    last block (a chain hash, so it names the whole prefix). Requests in flight on one
    endpoint hold a shared prefix once, however many sessions run on it."""

    key: int
    tokens: int
    # The prefix's length in the gateway's blocks: block_hashes[blocks - 1] is ``key``.
    blocks: int


def shared_part(tokens: int, shared: SharedPrefix | None) -> int:
    """The part of a claim of ``tokens`` that is a shared prefix's (0 without one)."""
    return 0 if shared is None else min(shared.tokens, tokens)


def count_shared(table: dict[int, list[int]], shared: SharedPrefix, part: int, sign: int) -> int:
    """One more holder of a shared prefix (``sign`` 1, holding ``part`` tokens of it) or one
    fewer (-1), in ``table`` (key -> [holders, its tokens]). Returns the change in what the
    holders hold together: the prefix's tokens where the first came or the last left, and
    where a newcomer counts them otherwise (the latest count stands: the estimate of tokens a
    byte improves as answers come, and a prefix held without a break would keep its first
    count for good)."""
    entry = table.get(shared.key)
    if sign > 0:
        if entry is None:
            table[shared.key] = [1, part]
            return part
        entry[0] += 1
        change, entry[1] = part - entry[1], part
        return change
    if entry is None:
        return 0
    entry[0] -= 1
    if entry[0] > 0:
        return 0
    del table[shared.key]
    return -entry[1]


def session_kv_held(held: list[int]) -> int:
    """The KV a session's requests in flight on one endpoint hold together
    (EndpointState.session_kv: [requests, largest claim, sum and largest of what each
    computes and answers]). Sub-agents forked from one context share it: the largest claim
    holds the context once, and each of the others adds its own part beyond it."""
    return held[1] + max(0, held[2] - held[3])


def _own_part(tokens: int, own: int | None) -> int:
    """A claim's own part as hold_kv and free_kv count it: all of it when not told."""
    return tokens if own is None else min(own, tokens)


def session_kv_added(held: list[int] | None, tokens: int, own: int) -> int:
    """What one more request of the session, claiming ``tokens`` of which ``own`` are its
    own (computed or answered), adds to what ``held`` holds (the whole claim where nothing
    of the session is in flight)."""
    if held is None:
        return tokens
    own = min(own, tokens)
    after = max(held[1], tokens) + max(0, held[2] + own - max(held[3], own))
    return after - session_kv_held(held)


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
    # The engine's learned sequence-slot limit (0: unknown: router/core/slots.py).
    slot_limit: int = 0
    # The KV cache this gateway's requests in flight there hold (their kv_claim tokens), and
    # the same at the last scrape (EngineMetrics.gateway_kv_tokens).
    in_flight_kv_tokens: int = 0
    scraped_kv_tokens: int = 0
    # How long a request holds its place there, a sequence slot and its KV (SlotLimit.hold).
    hold_s: float = 0.0
    # session -> what its requests in flight there hold (EndpointState.session_kv, not a
    # copy: read while scoring, which does not yield to the event loop).
    session_kv: Mapping[str, list[int]] = NO_SESSIONS
    # Shared prefixes held by requests in flight there (EndpointState.prefix_kv, not a copy).
    prefix_kv: Mapping[int, list[int]] = NO_PREFIXES

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
    # in flight at once (sub-agents forked from one context) share their context
    # (session_kv_held): session -> [requests, largest claim, sum and largest of what each
    # computes and answers].
    in_flight_kv_tokens: int = 0
    session_kv: dict[str, list[int]] = field(default_factory=dict)
    # Sessions sharing a prefix (SharedPrefix) hold it once: key -> [requests, its tokens].
    prefix_kv: dict[int, list[int]] = field(default_factory=dict)
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

    def hold_kv(
        self,
        tokens: int,
        session: str | None,
        own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> None:
        """A request in flight claims ``tokens`` of KV, of which ``own`` are its own (computed
        or answered; all of them when not told): the rest its session's others may share, and
        the ``shared`` prefix at its start other sessions' requests may hold already."""
        if shared is not None:
            part = shared_part(tokens, shared)
            tokens -= part
            self.in_flight_kv_tokens += count_shared(self.prefix_kv, shared, part, 1)
        if session is None:
            self.in_flight_kv_tokens += tokens
            return
        own = _own_part(tokens, own)
        held = self.session_kv.get(session)
        self.in_flight_kv_tokens += session_kv_added(held, tokens, own)
        if held is None:
            self.session_kv[session] = [1, tokens, own, own]
            return
        held[0] += 1
        held[1] = max(held[1], tokens)
        held[2] += own
        held[3] = max(held[3], own)

    def free_kv(
        self,
        tokens: int,
        session: str | None,
        own: int | None = None,
        shared: SharedPrefix | None = None,
    ) -> None:
        if shared is not None:
            tokens -= shared_part(tokens, shared)
            self.in_flight_kv_tokens += count_shared(self.prefix_kv, shared, 0, -1)
        if session is None:
            self.in_flight_kv_tokens -= tokens
            return
        held = self.session_kv.get(session)
        if held is None:
            return
        before = session_kv_held(held)
        held[0] -= 1
        if held[0] <= 0:
            self.in_flight_kv_tokens -= before
            del self.session_kv[session]
            return
        # The largest claim stays until the session's last request there ends: which of
        # them held it is not kept.
        held[2] -= _own_part(tokens, own)
        self.in_flight_kv_tokens += session_kv_held(held) - before

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
            self.in_flight_kv_tokens,
            m.gateway_kv_tokens,
            slots.hold(now),
            self.session_kv,
            self.prefix_kv,
        )
