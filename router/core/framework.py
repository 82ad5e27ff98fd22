"""Scheduling: gather, then score, then update.

A request's :class:`RoutingRequest` is filled by async *producers* (prefix-index lookup, session
lookup), then a :class:`SchedulingProfile` runs pure plugins over endpoint snapshots: filters
narrow the candidates, scorers give each a value in [0, 1], the weighted sum goes to a picker,
which returns the candidates in order of preference (the first is the pick, the rest are the
fallbacks for a retry). Index and affinity updates run after the pick, off the hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from router.core.endpoints import EndpointSnapshot, SharedPrefix

log = logging.getLogger("prefixgate.scheduling")


@dataclass(slots=True)
class RoutingRequest:
    """Per-request state: parsed facts first, then what the producers gathered."""

    request_id: str
    model: str
    api: str = "chat"
    stream: bool = False
    session_id: str | None = None
    # The session id a coding agent sent in its own header (router/protocol/agent_identity.py).
    agent_id: str | None = None
    fairness_id: str = "default"
    priority: int = 0
    prompt_bytes: int = 0
    prompt_tokens: int = 0
    block_bytes: int = 0
    block_hashes: Sequence[int] = ()
    # Byte span of the prompt's last answer (router.protocol.rendering.render_conversation): cached
    # where the turn that generated it was served, though no indexed prompt held it, in the
    # share the model's answers are found cached (router/estimators/answer_cache.py).
    answer_bytes: tuple[int, int] | None = None
    answer_share: float = 1.0
    # The tokens its answer is expected to generate (router/estimators/answer_lengths.py):
    # KV it adds while it decodes.
    answer_tokens: int = 0
    # Responses API: the stored response this request continues; only its endpoint can serve it.
    previous_response_id: str | None = None
    # Responses API: the answer is stored where it is served (not with ``store: false``).
    stores_response: bool = False
    # Report why this request went where it went: to the debug log, and to the client when
    # it asked and the gateway allows it (``explain_to_client``).
    explain: bool = False
    explain_to_client: bool = False
    # Filled by producers:
    prefix_hits: dict[str, int] = field(default_factory=dict)
    affinity_endpoint: str | None = None
    # Per endpoint, index blocks it can take before its cache (as the index sees it) must evict.
    cache_room: dict[str, int] = field(default_factory=dict)
    # Per endpoint, context tokens of the live sessions homed there
    # (router/estimators/live_sessions.py),
    # this request's own session excluded.
    live_tokens: dict[str, int] = field(default_factory=dict)
    # The leading prefix its session shares with other sessions (router/estimators/
    # live_sessions.py): held once by the requests in flight on an endpoint.
    shared_prefix: SharedPrefix | None = None
    # For the first request of a session: the requests the session is expected to send after
    # it, which will queue wherever this one goes (router/estimators/session_lengths.py). 0 for a
    # request
    # that carries no session or whose session has been placed already.
    later_requests: float = 0.0
    # Time-to-first-token target (x-llm-d-slo-ttft-ms, or the objective's), in seconds.
    ttft_slo_s: float | None = None
    # Told when the request takes an endpoint (its flow-control ticket's ``leased``).
    on_lease: Callable[[], None] | None = None
    # The prefill step of a disaggregated request (router/scheduling/disagg.py): its pick is
    # learned by the prefix index, but it neither places the session nor counts as its request.
    prefill_step: bool = False
    # Its prompt's KV comes from a prefill endpoint (router/scheduling/disagg.py): the decode
    # endpoint computes none of it, and its first byte says nothing of its prefill speed.
    remote_prefill: bool = False
    # Filled by the ranking when ``explain`` is set:
    explanation: dict[str, Any] | None = None
    # Unique among the router's requests, unlike a client's x-request-id: what per-request
    # tables (precise routing's) are keyed by.
    serial: int = 0

    def uncached_tokens(self, endpoint_id: str) -> int:
        """This request's prompt tokens the endpoint probably has to compute."""
        if not self.block_hashes or not self.prompt_bytes:
            return self.prompt_tokens
        return self.uncached_at(self.cached_bytes(endpoint_id) / self.prompt_bytes)

    def cached_bytes(self, endpoint_id: str) -> int:
        """The prompt bytes the endpoint probably holds: its index match, and the last answer
        beyond it where the endpoint served the turn that generated it."""
        matched = self.matched_bytes(endpoint_id)
        return matched + round(self.answer_share * self.answer_bytes_beyond(endpoint_id))

    def matched_bytes(self, endpoint_id: str) -> int:
        """The prompt bytes the prefix index matched on the endpoint."""
        return min(self.prefix_hits.get(endpoint_id, 0) * self.block_bytes, self.prompt_bytes)

    def leading_tokens(self, blocks: int) -> int:
        """This prompt's tokens in its first ``blocks`` blocks, at this request's count of
        tokens a byte (the learned ratio: a count carried from an earlier request may predate
        it)."""
        if not self.prompt_bytes:
            return 0
        return round(self.prompt_tokens * min(1.0, blocks * self.block_bytes / self.prompt_bytes))

    def answer_bytes_beyond(self, endpoint_id: str) -> int:
        """The last answer's bytes past the endpoint's match, if the match reaches the
        answer's start (every full block before it matched: the endpoint served the turn that
        generated it); else 0."""
        answer = self.answer_bytes
        hits = self.prefix_hits.get(endpoint_id, 0)
        if answer is None or not hits or hits < answer[0] // max(1, self.block_bytes):
            return 0
        return max(0, min(answer[1], self.prompt_bytes) - self.matched_bytes(endpoint_id))

    def kv_claim(self, uncached: int) -> int:
        """The KV cache tokens this request takes on an endpoint where ``uncached`` of its
        prompt is not cached, its answer's included. A session's whole prompt: its cached
        context is its own, idle in the cache until the request runs, and running holds it.
        Without a session, what it computes: its cached prefix is most likely a shared one
        that others running hold."""
        prompt = self.prompt_tokens if self.session_id is not None else uncached
        return prompt + self.kv_own(0)

    def kv_own(self, uncached: int) -> int:
        """The part of its KV claim the request computes itself: ``uncached`` of its prompt,
        and its answer (a prefill step answers one token)."""
        return uncached + (0 if self.prefill_step else self.answer_tokens)

    def uncached_at(self, share: float) -> int:
        """This request's prompt tokens left to compute where ``share`` of it is cached."""
        return max(1, round(self.prompt_tokens * (1.0 - share)))


@runtime_checkable
class Named(Protocol):
    """What every filter, scorer and picker declares: the type name it is registered under in a
    config's ``plugins`` (llm-d's plugin framework names each plugin by its type the same way)."""

    @property
    def type_name(self) -> str: ...


@runtime_checkable
class Filter(Named, Protocol):
    def filter(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[EndpointSnapshot]: ...


@runtime_checkable
class Explains(Protocol):
    """A scorer that can say why: its terms for one endpoint, in its own units."""

    def explain(self, request: RoutingRequest, endpoint: EndpointSnapshot) -> dict[str, float]:
        ...


@runtime_checkable
class Scorer(Named, Protocol):
    def score(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[float]:
        """One value in [0, 1] per endpoint, in the given order; higher is better."""
        ...


@runtime_checkable
class Picker(Named, Protocol):
    def pick(
        self,
        request: RoutingRequest,
        endpoints: Sequence[EndpointSnapshot],
        scores: Sequence[float],
    ) -> list[EndpointSnapshot]:
        """The endpoints in order of preference."""
        ...


# What a plugin factory builds: a profile takes each of its plugins as one of these three.
Plugin = Filter | Scorer | Picker


class Producer(Protocol):
    """Gathers data into the request before scoring; the only place where I/O may happen."""

    async def produce(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        ...


@runtime_checkable
class PickObserver(Protocol):
    """Learns from a pick right after it is made (index and affinity updates).

    Called synchronously so that the next request of a burst already sees this pick; an
    observer whose store needs I/O (Redis) updates its local view inline and runs the I/O
    in a background task of its own.
    """

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None: ...


@runtime_checkable
class UnpickObserver(Protocol):
    """Takes back what it learnt from a pick whose attempt failed before its first byte (a
    connect error, a timeout, a 5xx): the endpoint prefilled nothing of the request."""

    def on_unpick(self, request: RoutingRequest, endpoint_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: list[EndpointSnapshot]
    scores: dict[str, float]
    # Each scorer's clipped score by endpoint: filled only when the request is explained.
    breakdown: dict[str, dict[str, float]]
    profile: str = ""

    def explanation(
        self, request: RoutingRequest, scorers: Sequence[WeightedScorer]
    ) -> dict[str, Any]:
        """The pick and, best first, every endpoint's weighted total, scores and cost terms."""
        explainers = [(ws.name, ws.scorer) for ws in scorers if isinstance(ws.scorer, Explains)]
        endpoints = []
        for e in self.ranked:
            row: dict[str, Any] = {"id": e.id, "total": round(self.scores.get(e.id, 0.0), 4)}
            row.update({k: round(v, 4) for k, v in self.breakdown.get(e.id, {}).items()})
            for name, scorer in explainers:
                terms = scorer.explain(request, e)
                row[name + ".terms"] = {k: round(v, 4) for k, v in terms.items()}
            endpoints.append(row)
        pick = self.ranked[0].id if self.ranked else None
        return {"profile": self.profile, "pick": pick, "endpoints": endpoints}


@dataclass(slots=True)
class SchedulingProfile:
    name: str
    picker: Picker
    scorers: list[WeightedScorer] = field(default_factory=list)
    filters: list[Filter] = field(default_factory=list)

    def run(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        candidates = list(endpoints)
        for flt in self.filters:
            candidates = flt.filter(request, candidates)
            if not candidates:
                return Decision([], {}, {})
        totals = [0.0] * len(candidates)
        # Each scorer's part, kept only for an explanation (per candidate and scorer, a dict
        # entry nobody else reads).
        explain = request.explain
        breakdown: dict[str, dict[str, float]] = {e.id: {} for e in candidates} if explain else {}
        for ws in self.scorers:
            values = ws.scorer.score(request, candidates)
            weight = ws.weight
            for i, value in enumerate(values):
                clipped = min(1.0, max(0.0, value))
                totals[i] += weight * clipped
                if explain:
                    breakdown[candidates[i].id][ws.name] = clipped
        ranked = self.picker.pick(request, candidates, totals)
        scores = {e.id: t for e, t in zip(candidates, totals, strict=True)}
        decision = Decision(ranked, scores, breakdown, self.name)
        if explain:
            request.explanation = decision.explanation(request, self.scorers)
        return decision


class Scheduler:
    """Holds one profile with its producers (run before scoring) and observers (after the pick)."""

    def __init__(
        self,
        profile: SchedulingProfile,
        producers: Sequence[Producer] = (),
        observers: Sequence[PickObserver] = (),
    ) -> None:
        self.profile = profile
        self._producers = list(producers)
        self._observers = list(observers)

    async def gather(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        # In turn, not with asyncio.gather: a producer answering from memory completes without
        # suspending, so the request takes no trip through an event loop that is busy relaying
        # streams (gather wraps each producer in a task, two trips at least: measured, the
        # routing decision's p90 under load). One doing I/O costs its own round trip.
        for producer in self._producers:
            await producer.produce(request, endpoints)

    def picked(self, request: RoutingRequest, endpoint_id: str) -> None:
        for observer in self._observers:
            try:
                observer.on_pick(request, endpoint_id)
            except Exception:  # an update must never fail the request it learns from
                log.exception("pick observer %r failed", observer)

    def unpicked(self, request: RoutingRequest, endpoint_id: str) -> None:
        for observer in self._observers:
            if not isinstance(observer, UnpickObserver):
                continue
            try:
                observer.on_unpick(request, endpoint_id)
            except Exception:  # as on_pick: never the request's failure
                log.exception("pick observer %r failed to withdraw", observer)
