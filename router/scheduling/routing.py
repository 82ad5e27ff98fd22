"""From a parsed request to a ranked list of endpoints: admission, then scheduling.

Shared by every front door (the HTTP proxy, the Envoy ext_proc endpoint picker), so that flow
control, the prefix index and affinity behave the same whichever way a request arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from flow_control.controller import FlowController
from flow_control.request import Ticket
from router.config.model import GatewayConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import BadRequestError, ModelNotFoundError, NoEndpointsError
from router.core.framework import RoutingRequest, Scheduler, SchedulingProfile
from router.core.hashing import estimate_tokens
from router.core.lease import Lease
from router.core.pool import EndpointPool
from router.core.sampling import RateSampler
from router.estimators.answer_cache import AnswerCache
from router.estimators.answer_lengths import AnswerLengths
from router.estimators.calibration import Calibrator
from router.estimators.token_density import TokenDensity
from router.estimators.ttft_errors import PredictionErrors
from router.index.response_store import ResponseRoutes
from router.pool.metrics import GatewayMetrics
from router.protocol.agent_identity import AgentIdentity
from router.protocol.headers import EXPLAIN_HEADER
from router.protocol.parsing import Api, ParsedRequest, parse_request, prompt_hashes

SLO_HEADER = "x-llm-d-slo-ttft-ms"
# At DEBUG, one line per routing decision: every endpoint's scores and cost terms, the pick.
decision_log = logging.getLogger("prefixgate.decision")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A body parsed and its prompt hashed: the part of routing whose cost grows with the
    body and that reads no shared state, so a large body's can run in a worker thread."""

    parsed: ParsedRequest
    prompt_bytes: int
    block_hashes: list[int]


# How many streamed first bytes a second the calibrator learns from: every one at agents'
# rates; at thousands a second, a share (its fit is an average over hundreds of samples).
FIRST_BYTES_LEARNED_PER_S = 200.0
FIRST_BYTES_LEARNED_BURST = 200.0


class Router:
    # Whether routing reads a request's decoded payload (precise routing tokenizes it): then a
    # large body is parsed in a thread, since one parsed elsewhere would be decoded here again.
    reads_payload = False

    def __init__(
        self,
        config: GatewayConfig,
        pool: EndpointPool,
        candidates: Callable[[str], list[EndpointSnapshot]],
        scheduler: Scheduler,
        flow: FlowController,
        metrics: GatewayMetrics,
        *,
        responses: ResponseRoutes | None = None,
        calibrator: Calibrator | None = None,
        answers: AnswerCache | None = None,
        density: TokenDensity | None = None,
        learning: RateSampler | None = None,
        lengths: AnswerLengths | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._candidates = candidates
        self._scheduler = scheduler
        self._flow = flow
        self._metrics = metrics
        # Which endpoint holds each stored response (Responses API previous_response_id).
        self.responses = responses
        self._calibrator = calibrator or Calibrator()
        self._answers = answers or AnswerCache()
        # Answer lengths learned from the answers: the KV a request claims includes its own.
        self._lengths = lengths or AnswerLengths()
        self._errors = PredictionErrors()
        # Which streamed first bytes the calibrator and the prediction errors learn from: all
        # of them below the sampler's rate (router/core/sampling.py); None: every one.
        self._learning = learning
        self._serials = itertools.count(1)
        affinity = config.session_affinity
        self._identity = AgentIdentity(affinity.headers, affinity.agent_headers)
        # Bytes per token learned from the answers: the prompt's token estimate follows it.
        self._density = density

    def prepare(self, api: Api, body: bytes) -> Prepared:
        """Parse ``body`` and hash its rendered prompt into the block chain the index is keyed
        by (safe to call from a worker thread)."""
        return self._digest(parse_request(api, body))

    def _digest(self, parsed: ParsedRequest) -> Prepared:
        index = self._config.prefix_index
        size, hashes = prompt_hashes(parsed, index.block_bytes, index.max_blocks_per_request)
        return Prepared(parsed, size, hashes)

    def routing_request(
        self,
        parsed: ParsedRequest,
        headers: Mapping[str, str],
        request_id: str,
        prepared: Prepared | None = None,
    ) -> RoutingRequest:
        """The request's routing state; its prompt hashed here unless ``prepared`` was."""
        if not self._pool.knows_model(parsed.model):
            raise ModelNotFoundError(f"The model `{parsed.model}` does not exist.", param="model")
        index = self._config.prefix_index
        if prepared is None:
            prepared = self._digest(parsed)
        to_client = self._config.server.explain_header and headers.get(EXPLAIN_HEADER) == "1"
        identity = self._identity.identify(headers, parsed.session_hint)
        return RoutingRequest(
            request_id=request_id,
            serial=next(self._serials),
            model=parsed.model,
            api=parsed.api,
            stream=parsed.stream,
            session_id=identity.session,
            agent_id=identity.agent,
            previous_response_id=parsed.previous_response_id,
            stores_response=parsed.stored,
            explain=to_client or decision_log.isEnabledFor(logging.DEBUG),
            explain_to_client=to_client,
            prompt_bytes=prepared.prompt_bytes,
            prompt_tokens=self._estimate_tokens(parsed.model, prepared.prompt_bytes),
            block_bytes=index.block_bytes,
            # A follow-up's rendered input is the end of the replica's prompt, not its start:
            # its blocks are neither looked up nor indexed (the stored response pins it).
            block_hashes=() if parsed.previous_response_id else prepared.block_hashes,
            answer_bytes=parsed.answer_span,
            answer_share=self._answers.share(parsed.model),
            answer_tokens=self._lengths.tokens(parsed.model),
        )

    def _estimate_tokens(self, model: str, num_bytes: int) -> int:
        if self._density is None:
            return estimate_tokens(num_bytes)
        return estimate_tokens(num_bytes, self._density.ratio(model))

    async def admit(
        self, routing: RoutingRequest, headers: Mapping[str, str], size: int
    ) -> Ticket:
        """Wait for flow control to let the request through (or raise why it was shed)."""
        flow_request = self._flow.build_request(
            headers, routing.model, size=size, session_id=routing.session_id,
            default_fairness=routing.agent_id,
        )
        slo_ms = _slo_ms(headers) or self._flow.ttft_slo_ms(flow_request.objective)
        ticket = await self._flow.admit(flow_request)
        routing.fairness_id = flow_request.fairness_id
        routing.priority = flow_request.priority
        routing.ttft_slo_s = slo_ms / 1000 if slo_ms is not None else None
        routing.on_lease = ticket.leased
        return ticket

    async def rank(
        self,
        routing: RoutingRequest,
        allowed: Callable[[EndpointSnapshot], bool] | None = None,
        profile: SchedulingProfile | None = None,
    ) -> list[EndpointSnapshot]:
        """The candidates in order of preference: the pick first, then the fallbacks.

        ``allowed`` narrows the candidates (an Envoy subset hint, say); ``profile`` replaces
        the scheduler's own (the prefill pool's profile of a disaggregated fleet)."""
        started = time.perf_counter()
        if routing.previous_response_id is not None and profile is None:
            allowed = await self._pinned(routing, routing.previous_response_id, allowed)
        candidates = self._eligible(routing.model, allowed)
        if not candidates:
            raise NoEndpointsError(f"no healthy endpoint serves model {routing.model!r}")
        await self._scheduler.gather(routing, candidates)
        # The producers awaited (index, affinity, Redis): score snapshots taken now, so that
        # requests leased meanwhile count. Flow control lets one request through per freed
        # slot; scored on the snapshot from before the await, two such requests can both
        # land on the endpoint that had room and queue there, while another one sits idle.
        candidates = self._eligible(routing.model, allowed)
        if not candidates:
            raise NoEndpointsError(f"no healthy endpoint serves model {routing.model!r}")
        if routing.ttft_slo_s is not None and routing.priority < 0:
            self._check_slo(routing, routing.ttft_slo_s, candidates)
        decision = (profile or self._scheduler.profile).run(routing, candidates)
        if not decision.ranked:
            raise NoEndpointsError(f"no endpoint is eligible for model {routing.model!r}")
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        if routing.explanation is not None and decision_log.isEnabledFor(logging.DEBUG):
            decision_log.debug(
                "request %s: %s", routing.request_id, orjson.dumps(routing.explanation).decode()
            )
        return decision.ranked

    def _check_slo(
        self, routing: RoutingRequest, slo_s: float, candidates: list[EndpointSnapshot]
    ) -> None:
        """A sheddable request that no endpoint is predicted to answer in time is rejected
        now, while a retry elsewhere (or later) can still help its caller, instead of being
        answered late and taking capacity from requests that can still make their targets.
        The prediction is discounted by how optimistic recent ones proved (PredictionErrors),
        so only a request that will most likely miss is rejected; none before that is known."""
        optimistic = self._errors.optimistic_ratio()
        if optimistic is None:
            return
        best = optimistic * min(self.predicted_ttft(routing, c) for c in candidates)
        if best > slo_s:
            raise self._flow.reject_slo(
                f"predicted time to first token {best * 1000:.0f} ms exceeds the request's "
                f"target of {slo_s * 1000:.0f} ms"
            )

    def predicted_ttft(self, routing: RoutingRequest, endpoint: EndpointSnapshot) -> float:
        """Seconds to first byte on ``endpoint``, as the calibrator prices the request's own
        prefill behind what is queued and running there."""
        return self._calibrator.predict(
            endpoint.id,
            self.uncached_tokens(routing, endpoint.id),
            endpoint.pending_prefill_tokens,
            max(float(endpoint.in_flight), endpoint.running),
            endpoint.pending_prefill_requests,
        )

    async def _pinned(
        self,
        routing: RoutingRequest,
        response_id: str,
        allowed: Callable[[EndpointSnapshot], bool] | None,
    ) -> Callable[[EndpointSnapshot], bool]:
        """Only the endpoint holding the stored response (a 4xx when it cannot serve)."""
        if self.responses is None:
            return allowed or (lambda c: True)
        endpoint = await self.responses.resolve(
            response_id,
            self._pool,
            self._eligible(routing.model, allowed),
            param="previous_response_id",
            model=routing.model,
        )
        return lambda c: c.id == endpoint

    def _eligible(
        self, model: str, allowed: Callable[[EndpointSnapshot], bool] | None
    ) -> list[EndpointSnapshot]:
        candidates = self._candidates(model)
        return candidates if allowed is None else [c for c in candidates if allowed(c)]

    def lease(self, routing: RoutingRequest, endpoint: EndpointSnapshot) -> Lease:
        """Count the request against the endpoint until the lease is released.

        A streamed answer's first token (the lease's first byte with tokens) teaches the
        calibrator what the endpoint's first token costs: the time it took against this
        request's own prefill, the prefill queued there (tokens and requests) and the
        requests running there, as the ranking's snapshot counted them (every gateway's, the
        figures the cost scorer and flow control read).
        """
        endpoint_id = endpoint.id
        if self._pool.get(endpoint_id) is None:
            raise KeyError(endpoint_id)  # left the pool since it was ranked (the pool's own)
        if routing.on_lease is not None:
            routing.on_lease()
        # A decode after a remote prefill pulls the prompt's KV: it computes the last token.
        pulled = routing.remote_prefill
        if pulled:
            uncached = routing.uncached_at(1.0)
        else:
            uncached = self.uncached_tokens(routing, endpoint_id)
        queued = float(endpoint.pending_prefill_tokens)
        running = max(float(endpoint.in_flight), endpoint.running)
        requests = float(endpoint.pending_prefill_requests)
        calibrator, flow = self._calibrator, self._flow

        errors, learning = self._errors, self._learning

        pool = self._pool

        def first_byte(seconds: float, tokens: bool) -> None:
            # A non-streaming first byte is the answer's last; headers alone (ext_proc) come
            # before the request is even scheduled. An endpoint that has left the pool since
            # (its state forgotten) teaches nothing: learning would bring its state back.
            # A prefill step's answer comes at its first token; a decode after one waited for
            # a KV pull, which prices no prefill.
            timed = (routing.stream or routing.prefill_step) and not pulled
            if timed and tokens and pool.get(endpoint_id) is not None:
                price = calibrator.price(endpoint_id)
                if learning is None or learning.take():
                    errors.record(price.predict(uncached, queued, running, requests), seconds)
                    calibrator.observe(endpoint_id, uncached, seconds, queued, running, requests)
                idle = price.predict(uncached)
                flow.observe(endpoint_id, seconds / idle if idle > 0 else math.inf, int(requests))
            else:
                flow.poke()
            self.prefilled(routing, endpoint_id)

        # Its release frees its place, whenever it comes (given up before its first byte:
        # the client left, the endpoint failed, failover moved on): queued work goes at once.
        # A decode after a remote prefill holds the whole prompt's KV it pulled, as its own.
        own = routing.kv_own(routing.prompt_tokens if pulled else uncached)
        claim = own if pulled else routing.kv_claim(uncached)
        shared = None if pulled else routing.shared_prefix
        lease = self._pool.lease(
            endpoint_id, uncached, first_byte, flow.poke, claim, routing.session_id, own, shared
        )
        if not routing.stream:
            # Its first byte is its last: presume the prefill done after a generous multiple
            # of its predicted time, so decode time is not taken for queue.
            predicted = calibrator.predict(endpoint_id, uncached, queued, running, requests)
            delay = min(600.0, 3.0 * predicted)
            asyncio.get_running_loop().call_later(delay, _presume_prefilled, lease, flow)
        return lease

    def current(self, model: str, endpoint_id: str) -> EndpointSnapshot | None:
        """The endpoint as it stands now (a retry's, or a decode after its prefill step: the
        ranking's snapshot is older), or None when it is no longer a candidate for ``model``."""
        return next((c for c in self._candidates(model) if c.id == endpoint_id), None)

    def uncached_tokens(self, routing: RoutingRequest, endpoint_id: str) -> int:
        """The request's prompt tokens the endpoint will compute, as the queue it joins and the
        calibrator count them (hook: precise routing knows the replicas' caches better)."""
        return routing.uncached_tokens(endpoint_id)

    def prefilled(self, routing: RoutingRequest, endpoint_id: str) -> None:
        """The request's prefill is done on the endpoint (hook for subclasses)."""

    def picked(self, routing: RoutingRequest, endpoint_id: str) -> None:
        """Learn from the pick: prefix index and affinity updates, match-ratio metric."""
        if routing.block_hashes:
            ratio = routing.prefix_hits.get(endpoint_id, 0) / len(routing.block_hashes)
            self._metrics.prefix_match_ratio.observe(ratio)
        self._scheduler.picked(routing, endpoint_id)

    def unpicked(self, routing: RoutingRequest, endpoint_id: str) -> None:
        """The recorded pick's attempt failed before its first byte: withdraw its updates."""
        self._scheduler.unpicked(routing, endpoint_id)


def _slo_ms(headers: Mapping[str, str]) -> float | None:
    raw = headers.get(SLO_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise BadRequestError(f"{SLO_HEADER} must be a positive number of milliseconds")
    return value


def _presume_prefilled(lease: Lease, flow: FlowController) -> None:
    lease.presume_prefilled()
    flow.poke()  # the endpoint's prefill queue is one shorter
