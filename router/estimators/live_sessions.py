"""Live sessions: how much context each endpoint's cache must keep for sessions still running.

A replica's KV cache is usually full of something; what matters is whether it is full of
context someone will come back for. An agent session returns to its endpoint turn after turn,
so the contexts of the sessions homed on an endpoint, and still live, are what new blocks
there would evict. The contexts of sessions that ended or moved away cost nothing to evict.

A session counts once it has come back (a second request: single-turn traffic never does),
and stays live while it keeps to its own pace: it expires when it has been quiet for
``HORIZON_GAPS`` times the typical gap between a session's requests, learned from the traffic
(between ``MIN_HORIZON_S`` and ``MAX_HORIZON_S``). Its context is its last prompt.

Sessions of one agent type share a system prompt and tools, often most of a young context: a
cache holding eight such sessions holds that prefix once. So a session's first request also
names the prefix it shares with others (``RoutingRequest.shared_prefix``: the longest prefix
the index holds anywhere when the session starts, before it has sent anything of its own), and
each endpoint counts each shared prefix once. Summed as if distinct, a replica holding many
sessions of one type read as full, and new turns and sessions were priced off it onto replicas
holding other types, whose prefixes they then evicted (docs/routing.md).

Each gateway replica counts the sessions it served (with several gateways behind a balancer, a
session's turns spread over them, and each sees its share).

The producer also hands the first request of each new session the requests the session is
expected to send after it (``RoutingRequest.later_requests``, router/estimators/session_lengths.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from router.core.endpoints import EndpointSnapshot, SharedPrefix, count_shared, shared_part
from router.core.framework import RoutingRequest
from router.estimators.session_lengths import SessionLengths

HORIZON_GAPS = 3.0
MIN_HORIZON_S = 1.0
MAX_HORIZON_S = 600.0
# Requests of one session closer than this are a parallel burst (sub-agents), not a pace.
BURST_GAP_S = 0.05
GAP_AVERAGE_WEIGHT = 0.05
INITIAL_GAP_S = 10.0


@dataclass(slots=True)
class _Session:
    endpoint_id: str
    tokens: int
    last_seen: float
    requests: int
    # The last request placed (RoutingRequest.serial; 0: unknown): picked again, it is that
    # request's retry on another endpoint, not the session coming back.
    serial: int = 0
    # Where the session was before that request placed it (endpoint, context; None: it was
    # new), for a pick that served nothing to be undone (on_unpick).
    before: tuple[str, int] | None = None
    withdrawn: bool = False  # that request's pick was undone: a retry's pick counts it again
    shared: SharedPrefix | None = None


class LiveSessions:
    """Producer (``request.live_tokens``) and pick observer of the sessions' contexts."""

    def __init__(
        self,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._max = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # The live ones, oldest last_seen first: expiry pops from the front.
        self._live: OrderedDict[str, _Session] = OrderedDict()
        self._tokens: dict[str, int] = {}
        # endpoint -> shared prefix key -> [live sessions holding it there, its tokens]
        self._prefixes: dict[str, dict[int, list[int]]] = {}
        self.typical_gap = INITIAL_GAP_S
        self._gaps = 0
        self.lengths = SessionLengths(max_sessions)
        if registry is not None:
            registry.register(self)

    @property
    def horizon(self) -> float:
        return min(MAX_HORIZON_S, max(MIN_HORIZON_S, HORIZON_GAPS * self.typical_gap))

    def live_tokens(self, endpoint_id: str) -> int:
        self._expire(self._clock())
        return self._tokens.get(endpoint_id, 0)

    async def produce(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        self._expire(self._clock())
        tokens = {e.id: self._tokens.get(e.id, 0) for e in endpoints}
        session_id = request.session_id
        own = self._live.get(session_id) if session_id else None
        if own is not None and own.endpoint_id in tokens:
            # Its own context is extended by this request, not evicted.
            tokens[own.endpoint_id] -= self._held_alone(own)
        request.live_tokens = tokens
        if session_id:
            request.shared_prefix = self._shared_prefix(request, self._sessions.get(session_id))
            if self.lengths.is_new(session_id):
                request.later_requests = self.lengths.later_requests

    def _held_alone(self, session: _Session) -> int:
        """The context tokens only this live session keeps on its endpoint: its own, and its
        shared prefix where no other live session there shares it."""
        shared = session.shared
        part = shared_part(session.tokens, shared)
        alone = session.tokens - part
        prefixes = self._prefixes.get(session.endpoint_id)
        if shared is not None and prefixes is not None:
            entry = prefixes.get(shared.key)
            if entry is not None and entry[0] <= 1:
                alone += entry[1]
        return alone

    @staticmethod
    def _shared_prefix(request: RoutingRequest, session: _Session | None) -> SharedPrefix | None:
        """A known session's shared prefix if this prompt still starts with it; for a new one,
        the longest prefix the index holds anywhere (other sessions' prompts: the session has
        sent nothing yet). Its tokens are counted anew each time: a session's first request
        often comes before the gateway has learned the model's bytes a token, and a count
        carried from it would be off by as much for the session's life."""
        hashes = request.block_hashes
        if session is not None:
            shared = session.shared
            if shared is None or len(hashes) < shared.blocks:
                return None
            if hashes[shared.blocks - 1] != shared.key:
                return None
            blocks = shared.blocks
        else:
            blocks = min(max(request.prefix_hits.values(), default=0), len(hashes))
        if blocks <= 0 or not request.prompt_bytes:
            return None
        return SharedPrefix(hashes[blocks - 1], request.leading_tokens(blocks), blocks)

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None:
        session_id = request.session_id
        if not session_id or request.prefill_step:  # the decode pick places the session
            return
        now = self._clock()
        session = self._sessions.get(session_id)
        # Failover picks a request again on its next endpoint: the session moves with it.
        retry = session is not None and request.serial != 0 and session.serial == request.serial
        if not retry:
            self.lengths.on_request(session_id, now)
        if not retry and session is not None:
            session.before = (session.endpoint_id, session.tokens)
        if session is None:
            session = self._sessions[session_id] = _Session(endpoint_id, 0, now, 0)
            while len(self._sessions) > self._max:
                self._retire(self._sessions.popitem(last=False)[0])
        else:
            self._sessions.move_to_end(session_id)
            if not retry:
                self._learn_gap(now - session.last_seen)
            self._retire(session_id)
        session.endpoint_id, session.tokens = endpoint_id, request.prompt_tokens
        session.shared = request.shared_prefix
        session.last_seen, session.serial = now, request.serial
        if not retry or session.withdrawn:
            session.requests += 1
        session.withdrawn = False
        self._count(session_id, session)

    def on_unpick(self, request: RoutingRequest, endpoint_id: str) -> None:
        """The pick's attempt failed before its first byte: the endpoint never got the
        context, so the session is back where it was (a new one counts nowhere, and this
        request is not one of its turns); a retry that is answered places it again."""
        session_id = request.session_id
        session = self._sessions.get(session_id) if session_id else None
        if session_id is None or session is None or request.prefill_step:
            return
        if session.withdrawn or (session.serial, session.endpoint_id) != (
            request.serial,
            endpoint_id,
        ):
            return  # not this request's placement (a later request's, say)
        self._retire(session_id)
        session.withdrawn = True
        session.requests -= 1
        if session.before is not None:
            session.endpoint_id, session.tokens = session.before
            self._count(session_id, session)

    def _count(self, session_id: str, session: _Session) -> None:
        """A session placed (and not live: retired first): live once it has come back."""
        if session.requests >= 2:
            self._live[session_id] = session
            self._add(session, 1)

    def clear_endpoint(self, endpoint_id: str) -> None:
        """The endpoint's engine restarted: the contexts of the sessions homed there are gone
        from its cache, so they no longer count as live there (each counts again from its
        next request, wherever that goes)."""
        homed = [s for s, session in self._live.items() if session.endpoint_id == endpoint_id]
        for session_id in homed:
            self._retire(session_id)

    def _learn_gap(self, gap: float) -> None:
        """The mean of the first gaps, then an exponential average (the traffic's pace drifts)."""
        if gap < BURST_GAP_S:
            return
        self._gaps += 1
        weight = max(1.0 / self._gaps, GAP_AVERAGE_WEIGHT)
        self.typical_gap += weight * (min(gap, MAX_HORIZON_S) - self.typical_gap)

    def _retire(self, session_id: str) -> None:
        """Takes a live session's context out of its endpoint's sum (before an update, on
        expiry or when the table drops it)."""
        session = self._live.pop(session_id, None)
        if session is not None:
            self._add(session, -1)

    def _add(self, session: _Session, sign: int) -> None:
        """Counts a live session's context on its endpoint (``sign`` 1) or takes it out (-1):
        its own part, and its shared prefix once among the live sessions there."""
        endpoint_id, shared = session.endpoint_id, session.shared
        part = shared_part(session.tokens, shared)
        delta = sign * (session.tokens - part)
        if shared is not None:
            prefixes = self._prefixes.setdefault(endpoint_id, {})
            delta += count_shared(prefixes, shared, part, sign)
            if not prefixes:
                del self._prefixes[endpoint_id]
        left = self._tokens.get(endpoint_id, 0) + delta
        if left > 0:
            self._tokens[endpoint_id] = left
        else:
            self._tokens.pop(endpoint_id, None)

    def _expire(self, now: float) -> None:
        cutoff = now - self.horizon
        self.lengths.expire(cutoff)
        live = self._live
        while live:
            session_id, session = next(iter(live.items()))
            if session.last_seen >= cutoff:
                return
            self._retire(session_id)

    def collect(self) -> Iterator[Metric]:
        """Read at scrape time (on the event loop, as every other access)."""
        self._expire(self._clock())
        tokens = GaugeMetricFamily(
            "prefixgate_live_session_context_tokens",
            "Context tokens of the live sessions homed on each endpoint (what new blocks there "
            "would evict)",
            labels=["endpoint"],
        )
        for endpoint_id, count in sorted(self._tokens.items()):
            tokens.add_metric([endpoint_id], count)
        yield tokens
        yield GaugeMetricFamily(
            "prefixgate_live_sessions", "Sessions counted as live", value=len(self._live)
        )
        yield GaugeMetricFamily(
            "prefixgate_session_later_requests",
            "Requests a new session is expected to send after its first (learned from the "
            "sessions seen; router/estimators/session_lengths.py)",
            value=self.lengths.later_requests,
        )
        yield GaugeMetricFamily(
            "prefixgate_live_session_horizon_seconds",
            "Quiet time after which a session no longer counts as live",
            value=self.horizon,
        )
