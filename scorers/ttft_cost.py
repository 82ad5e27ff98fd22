"""TTFT-cost scorer: every endpoint priced in one common unit, the predicted time to first token.

Unlike min-max scaled scores, magnitudes survive: a 50,000-token miss costs a thousand times a
50-token miss, so a session stays where its context lives until the time there is clearly more
than recomputing it elsewhere (a fifth, ``homeMargin``), and new sessions and sub-agent bursts
spread by cost. The score is ``cheapest cost / cost``, so it keeps its meaning when mixed with
other weighted scorers. The terms of the cost and why each is there: docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import Field, model_validator

from router.core.endpoints import EndpointSnapshot, session_kv_added, shared_part
from router.core.framework import RoutingRequest
from router.core.strict import Strict
from router.estimators.calibration import Calibrator
from scorers.precise_prefix_cache import PreciseScores


class TTFTCostParameters(Strict):
    """Every term but the measured prefill is in prompt-token equivalents, priced at the
    endpoint's learned cost per token: the model means the same at any hardware speed."""

    # Uncached tokens assumed for each request waiting in a replica that this gateway did not
    # send (another gateway's, or one sent before a restart).
    foreign_request_tokens: int = Field(512, ge=0)
    # Decode pressure, at least: each running request slows every step this request shares
    # with it, its prefill and its whole answer (~0.05 ms a token over a ~300-token agent
    # answer on the 8B-on-H100 profile, ~8 ms, i.e. ~40 prompt tokens). It is also what sends
    # new work to a replica that just came back with an empty cache. Where the fleet's first
    # bytes show a running request costs more, the learned price is used.
    running_request_tokens: float = Field(40.0, ge=0)
    # This request's uncached tokens on an endpoint weigh more than tokens already queued
    # there: a recompute delays not only this request but every request that queues behind it
    # before it is done. How many do is read off the endpoint's queue now (requests waiting for
    # a first byte): the weight is recomputeWeight on an idle endpoint, plus
    # recomputeWeightPerQueued for each request queued there, up to recomputeWeightMax. So at
    # light load a session moves off a busy replica to an idle one as soon as the queue costs
    # more than the recompute, and at overload, when every queue is long, it stays home.
    recompute_weight: float = Field(1.0, ge=1.0, le=4.0)
    recompute_weight_per_queued: float = Field(0.1, ge=0.0, le=4.0)
    recompute_weight_max: float = Field(2.0, ge=1.0, le=8.0)
    # The queue an endpoint kept over the last seconds, weighed against the queue there now:
    # a session placed on an endpoint comes back to it turn after turn, so a replica busy a
    # second ago but momentarily empty is not an idle one.
    recent_queue_weight: float = Field(1.0, ge=0.0, le=1.0)
    # A session's first request also places the session: its later requests (as many as
    # sessions have sent on average, router/estimators/session_lengths.py) will meet the queue its
    # home
    # keeps. So the first request is charged, on each endpoint, that many times the queue the
    # endpoint kept over the last seconds, times this weight. Recomputing a shared system prompt
    # once on a replica with room is then cheaper than queueing a whole session behind the
    # replicas that already hold it; the queue now is priced for the first request as for any.
    placement_horizon_weight: float = Field(1.0, ge=0.0, le=4.0)
    # Each token of cached context that this request's new blocks would evict on an endpoint
    # (its cache full of context worth keeping: see evictionRoom) weighs this much: someone's
    # context, most likely recomputed later (agent sessions come back after each tool call).
    # It is what keeps sessions home when every cache is full, and costs nothing while caches
    # have room.
    eviction_weight: float = Field(1.0, ge=0.0, le=4.0)
    # For a request without a session, each token of its prefix that another endpoint holds
    # and this one would recompute weighs this much, where that is more than the eviction
    # term above: the copy takes room that evicts someone's context, now (the eviction term)
    # or once the cache fills, and splits the prefix's later hits between two caches.
    # Without it, recomputing a shared prefix on an idle replica priced as cheap as a short
    # wait where it is cached, and single-turn traffic on shared prompts scattered over the
    # fleet. A session's requests are not charged: its context is its own (moving it leaves
    # the old copy to age out, not a second live one), and where its first request copies a
    # shared system prompt is the session's placement, which placementHorizonWeight prices.
    copy_weight: float = Field(1.0, ge=0.0, le=4.0)
    # The room an endpoint's cache has for new blocks: "live-sessions" counts only the contexts
    # of live sessions homed there as worth keeping (router/estimators/live_sessions.py: a cache
    # full of
    # ended sessions' contexts has room), falling back to "index" where the endpoint does not
    # report its capacity; "index" counts every entry of the prefix index.
    eviction_room: Literal["live-sessions", "index"] = "live-sessions"
    # The wait for room in the endpoint's KV cache where the request would not fit beside
    # what runs there (_kv_wait_s), in seconds, times this: 1 prices it as estimated, 0
    # ignores it.
    kv_wait_weight: float = Field(1.0, ge=0.0, le=4.0)
    # A nudge towards the endpoint that served the session last, for near ties.
    affinity_bonus_tokens: float = Field(25.0, ge=0)
    # The endpoint that served the session last is priced at (1 - this) of its predicted
    # time: a session leaves it only for an endpoint predicted that much faster. The
    # prediction's error is larger than the small margins many moves were decided on, and a
    # move costs what it does not price: a second copy of the context taking cache room on
    # the new endpoint, the old one lingering, the next turns' hits split (docs/routing.md).
    # Scaled by the share of the prompt home holds: a home that lost the context keeps none.
    home_margin: float = Field(0.2, ge=0.0, le=0.9)
    # The wait for a sequence slot where the engine's are all taken (its learned limit:
    # router/core/slots.py), in seconds, times this: 1 prices it as measured, 0 ignores it.
    slot_wait_weight: float = Field(1.0, ge=0.0, le=4.0)
    # Where the uncached tokens come from: the approximate index, or the replicas' KV events
    # (precise prefix routing; endpoints without a trusted stream fall back to approximate).
    prefix_source: Literal["approximate", "precise"] = "approximate"

    @model_validator(mode="after")
    def _max_not_below_base(self) -> TTFTCostParameters:
        if self.recompute_weight_max < self.recompute_weight:
            raise ValueError(
                f"recomputeWeightMax ({self.recompute_weight_max}) is below recomputeWeight "
                f"({self.recompute_weight})"
            )
        return self


class CostTerms(NamedTuple):
    """One endpoint's priced terms (a named tuple: built for every candidate of every request,
    in a third of a frozen dataclass's time)."""

    endpoint: str
    queued_tokens: float
    queued_requests: float
    uncached_tokens: int
    recompute_weight: float
    evicted_tokens: int
    prefill_s: float
    load_s: float
    kv_wait_s: float
    affinity_bonus_s: float
    horizon_s: float = 0.0
    copied_tokens: int = 0
    slot_wait_s: float = 0.0
    home_margin: float = 0.0

    @property
    def predicted_s(self) -> float:
        """This request's predicted time to first token on the endpoint."""
        # Waits for a sequence slot and for KV room overlap: the longer one is the wait.
        return self.prefill_s + self.load_s + max(self.slot_wait_s, self.kv_wait_s)

    @property
    def total_s(self) -> float:
        """The price the endpoint is scored by: the prediction, the session's later requests'
        queue (horizon), the home's margin and bonus."""
        cost = (self.predicted_s + self.horizon_s) * (1.0 - self.home_margin)
        return max(1e-6, cost - self.affinity_bonus_s)


class TTFTCostScorer:
    type_name = "ttft-cost-scorer"

    def __init__(
        self,
        calibrator: Calibrator,
        params: TTFTCostParameters | None = None,
        precise: PreciseScores | None = None,
    ) -> None:
        self._calibrator = calibrator
        self._p = params or TTFTCostParameters()
        self._precise = precise if self._p.prefix_source == "precise" else None

    def _uncached(self, request: RoutingRequest, endpoint_id: str) -> int:
        precise = self._precise
        share = precise.held_share(request.serial, endpoint_id) if precise else None
        if share is None:
            return request.uncached_tokens(endpoint_id)
        return request.uncached_at(share)

    def least_uncached(self, request: RoutingRequest) -> int:
        """The fewest uncached tokens this request has on any endpoint holding part of it
        (for one endpoint's explanation; scoring takes the least among its candidates)."""
        hits = request.prefix_hits
        return min((self._uncached(request, e) for e in hits), default=request.prompt_tokens)

    def terms(
        self,
        request: RoutingRequest,
        endpoint: EndpointSnapshot,
        least: int | None = None,
        uncached: int | None = None,
    ) -> CostTerms:
        p = self._p
        price = self._calibrator.price(endpoint.id)
        per_token = price.per_token_s
        if uncached is None:
            uncached = self._uncached(request, endpoint.id)
        evicted = self._evicted_tokens(request, endpoint, uncached)
        copied = 0
        if request.session_id is None:
            least = self.least_uncached(request) if least is None else least
            copied = max(0, uncached - least)
        foreign_requests = endpoint.foreign_waiting
        pending = float(endpoint.pending_prefill_tokens)
        pending += p.recent_queue_weight * max(0.0, endpoint.recent_prefill_tokens - pending)
        queued = pending + foreign_requests * p.foreign_request_tokens
        queued_requests = endpoint.pending_prefill_requests + foreign_requests
        weight = self._recompute_weight(queued_requests)
        own = weight * uncached + max(p.eviction_weight * evicted, p.copy_weight * copied)
        prefill = price.predict(own, queued, queued_requests=queued_requests)
        running = max(float(endpoint.in_flight), endpoint.running)
        # The configured decode pressure (which also slows this request's answer) at least;
        # more where the fleet's first bytes show running requests cost more.
        per_running = max(per_token * p.running_request_tokens, price.per_running_s)
        load = per_running * running
        home = request.affinity_endpoint == endpoint.id
        bonus = per_token * p.affinity_bonus_tokens if home else 0.0
        margin = p.home_margin * _held_share(request, uncached) if home else 0.0
        penalty = p.kv_wait_weight * _kv_wait_s(endpoint, _kv_claim(request, endpoint, uncached))
        horizon = (
            p.placement_horizon_weight * request.later_requests
            * price.per_queued_token_s * endpoint.recent_prefill_tokens
        )  # fmt: skip
        return CostTerms(
            endpoint.id, queued, queued_requests, uncached, weight, evicted, prefill, load,
            penalty, bonus, horizon, copied, p.slot_wait_weight * _slot_wait_s(endpoint), margin,
        )

    def _recompute_weight(self, queued_requests: float) -> float:
        p = self._p
        weight = p.recompute_weight + p.recompute_weight_per_queued * queued_requests
        return min(p.recompute_weight_max, weight)

    def _evicted_tokens(
        self, request: RoutingRequest, endpoint: EndpointSnapshot, uncached: int
    ) -> int:
        live = request.live_tokens.get(endpoint.id)
        capacity = _capacity_tokens(endpoint)
        if self._p.eviction_room == "live-sessions" and live is not None and capacity:
            return max(0, uncached - max(0, capacity - live))
        room = request.cache_room.get(endpoint.id)
        if room is None or not request.block_hashes:
            return 0
        tokens_per_block = request.prompt_tokens / len(request.block_hashes)
        return max(0, uncached - round(room * tokens_per_block))

    def explain(self, request: RoutingRequest, endpoint: EndpointSnapshot) -> dict[str, float]:
        t = self.terms(request, endpoint)
        capacity = _capacity_tokens(endpoint)
        return {
            "predicted_ttft_s": t.predicted_s, "priced_s": t.total_s,
            "queued_tokens": t.queued_tokens,
            "queued_requests": t.queued_requests,
            "speed_factor": self._calibrator.factor(endpoint.id),
            "uncached_tokens": t.uncached_tokens, "recompute_weight": t.recompute_weight,
            "evicted_tokens": t.evicted_tokens, "copied_tokens": t.copied_tokens,
            "prefill_s": t.prefill_s, "load_s": t.load_s, "kv_wait_s": t.kv_wait_s,
            "affinity_bonus_s": t.affinity_bonus_s, "horizon_s": t.horizon_s,
            "slot_wait_s": t.slot_wait_s, "home_margin": t.home_margin,
            # What the wait for KV room was reckoned from: a count that stands still while
            # replicas preempt is visible here (docs/routing.md, *shared prefixes*).
            "kv_held_tokens": round(_kv_held(endpoint, capacity)),
            "kv_claim_tokens": _kv_claim(request, endpoint, t.uncached_tokens),
            "kv_capacity_tokens": capacity, "hold_s": endpoint.hold_s,
        }

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        if self._precise is not None:
            # Matches the request once (speculative entries of the picks before it included);
            # the tracker keeps the result for _uncached, and for explain() after the pick.
            self._precise.scores(request, endpoints)
        # The least among the candidates: a holder the filters left out (a prefill-only
        # endpoint, for a decode pick) is no copy this request could be spared.
        uncached = [self._uncached(request, e.id) for e in endpoints]
        hits = request.prefix_hits
        least = min(
            (u for e, u in zip(endpoints, uncached, strict=True) if e.id in hits),
            default=request.prompt_tokens,
        )
        costs = [
            self.terms(request, e, least, u).total_s
            for e, u in zip(endpoints, uncached, strict=True)
        ]
        if not costs:
            return []
        best = min(costs)
        return [best / c for c in costs]


def _held_share(request: RoutingRequest, uncached: int) -> float:
    """The share of the prompt the endpoint holds: what the home margin keeps is the context
    cached there, so a home that lost it (evicted, restarted) keeps only that share."""
    if request.prompt_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - uncached / request.prompt_tokens))


def _capacity_tokens(endpoint: EndpointSnapshot) -> int:
    """The tokens the endpoint's KV cache holds (``vllm:cache_config_info``); 0 if unknown."""
    return (endpoint.num_gpu_blocks or 0) * (endpoint.block_size or 0)


def _slot_wait_s(endpoint: EndpointSnapshot) -> float:
    """The wait for a sequence slot: with every slot of the engine taken (its learned limit,
    router/core/slots.py), the k-th request in line starts after k of the running ones end,
    about one every ``hold / limit`` seconds. Whatever its cached prefix saves, a request
    there waits this long before its prefill starts."""
    limit = endpoint.slot_limit
    if not limit:
        return 0.0
    occupants = max(float(endpoint.in_flight), endpoint.running + endpoint.waiting)
    excess = occupants + 1 - limit
    return excess * endpoint.hold_s / limit if excess > 0 else 0.0


def _kv_claim(request: RoutingRequest, endpoint: EndpointSnapshot, uncached: int) -> int:
    """The KV the request would add on the endpoint (RoutingRequest.kv_claim): where its
    session has requests in flight there (sub-agents forked from one context), they hold the
    context already, and it adds what it computes, its answer included
    (router.core.endpoints.session_kv_added); where other sessions' requests in flight there
    share its leading prefix (an agent type's system prompt), they hold that part."""
    claim = request.kv_claim(uncached)
    shared = request.shared_prefix
    part = shared_part(claim, shared)
    added = 0 if shared is None or shared.key in endpoint.prefix_kv else part
    held = endpoint.session_kv.get(request.session_id) if request.session_id else None
    return added + session_kv_added(held, claim - part, request.kv_own(uncached))


def _kv_wait_s(endpoint: EndpointSnapshot, claim: int) -> float:
    """The wait for KV room: where the request's ``claim`` (RoutingRequest.kv_claim) does not
    fit beside what the requests there hold, vLLM admits it only once enough of them end.
    What runs frees about once every hold time, and no more than the cache holds runs at
    once: beyond it the requests ahead go in waves, each a hold time. What is held:
    _kv_held."""
    capacity = _capacity_tokens(endpoint)
    if not capacity:
        return 0.0
    held = _kv_held(endpoint, capacity)
    excess = held + claim - capacity
    if excess <= 0 or held <= 0:
        return 0.0
    return min(excess, held) / min(held, capacity) * endpoint.hold_s


def _kv_held(endpoint: EndpointSnapshot, capacity: int) -> float:
    """The KV held on the endpoint (of ``capacity`` tokens): this gateway's claims in flight
    now, plus what the scrape showed beyond this gateway's claims in flight then (others'
    requests; this gateway's own that ended since are no longer held)."""
    return endpoint.in_flight_kv_tokens + max(
        0.0, endpoint.kv_usage * capacity - endpoint.scraped_kv_tokens
    )
