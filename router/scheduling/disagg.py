"""Disaggregated prefill and decode: the decider and the two-step orchestration.

The decode profile ranks the decode pool for every request; when that pick would compute at
least ``nonCachedTokens`` uncached prompt tokens, the prefill profile ranks the prefill pool.
``two-step`` follows vLLM's NixlConnector proxy protocol (a ``max_tokens: 1`` prefill whose
``kv_transfer_params`` go with the original request to the decode endpoint); ``sidecar`` only
names the prefiller in ``x-prefiller-host-port`` for llm-d's routing sidecar. A failed prefill
falls back to a plain decode request. A request for its prompt's logprobs is not split (a
decode endpoint that pulls the KV has no prompt logits). The decode request of a split one is
marked ``remote_prefill``: its endpoint counts none of the prompt as its prefill. Why 1024
tokens by default: docs/disaggregation.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson
from prometheus_client import Counter, Histogram
from starlette.responses import Response

from router.config.model import DisaggregationConfig, PluginConfig, ProfileConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import NoEndpointsError
from router.core.framework import RoutingRequest, SchedulingProfile
from router.core.lease import Lease
from router.pool.metrics import GatewayMetrics
from router.protocol.parsing import ParsedRequest
from router.scheduling.filters import decode_filter, prefill_filter
from router.scheduling.plugins import PluginContext, PluginRegistry, build_profile
from router.scheduling.routing import Router
from router.upstream.client import UPSTREAM_ERRORS, UpstreamReply

log = logging.getLogger("prefixgate.disagg")

PREFILLER_HEADER = "x-prefiller-host-port"
# The APIs a prefill step speaks (vLLM's P/D proxy protocol, llm-d's sidecar): the agent APIs
# go to decode alone, as does a Responses follow-up (only its endpoint holds the stored turns).
SPLIT_APIS = frozenset({"chat", "completions"})
PREFILL_PROFILE = "prefill"
DECODE_PROFILE = "decode"
# A prefill answer is one token, usage and the block ids of the prompt (~6 bytes a block).
_MAX_PREFILL_ANSWER = 8 << 20
_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# What a prefill endpoint is asked to do (vLLM NixlConnector): compute, keep the KV cache for
# a remote decode, answer after the first token.
_PREFILL_KV_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PrefillDecider(Protocol):
    """Whether a request's prefill should run on the prefill pool, given its decode pick."""

    def needs_prefill(self, request: RoutingRequest, decode: EndpointSnapshot) -> bool: ...


class UncachedTokensDecider:
    """Remote prefill once the decode pick would compute at least ``threshold`` tokens.

    ``uncached`` counts them as the router does (``Router.uncached_tokens``: precise routing
    knows the replicas' caches better than the approximate index's hits on the request)."""

    def __init__(
        self,
        threshold: int,
        uncached: Callable[[RoutingRequest, str], int] = RoutingRequest.uncached_tokens,
    ) -> None:
        self.threshold = threshold
        self._uncached = uncached

    def needs_prefill(self, request: RoutingRequest, decode: EndpointSnapshot) -> bool:
        return self._uncached(request, decode.id) >= self.threshold


def wants_prompt_logprobs(api: str, payload: Mapping[str, Any]) -> bool:
    """Whether the request asks for its prompt's logprobs (vLLM's ``prompt_logprobs``, or a
    completion's ``echo`` with ``logprobs``): only the endpoint that computes the prompt has
    them, and a vLLM decode endpoint fed a pulled KV cache fails on such a request."""
    if payload.get("prompt_logprobs") is not None:
        return True
    echo = api == "completions" and bool(payload.get("echo"))
    return echo and payload.get("logprobs") is not None


# Sends one body to one endpoint (the proxy's client, with the request's upstream headers).
PrefillPost = Callable[[EndpointSnapshot, str, bytes], Awaitable[UpstreamReply]]
# Counts a failed prefill request towards its endpoint's outlier ejection (the proxy's
# failover: lease, endpoint id, kind), as any failed attempt is.
PrefillFailed = Callable[[Lease, str, str], None]


def prefill_payload(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request: the original body, asked for one token, not streamed."""
    out = {k: v for k, v in payload.items() if k not in ("stream_options", "min_tokens")}
    out["kv_transfer_params"] = dict(_PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_payload(payload: Mapping[str, Any], kv_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode request: the original body plus what the prefill endpoint handed over."""
    return {**payload, "kv_transfer_params": dict(kv_params)}


def kv_params_of(answer: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a prefill answer, or None if it has none (or is no JSON)."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return params if isinstance(params, dict) and params else None


@dataclass(slots=True)
class DecodeStep:
    """What the proxy sends to the decode pool after the prefill step (or instead of it)."""

    parsed: ParsedRequest
    headers: list[tuple[str, str]] = field(default_factory=list)
    # A prefill 4xx, answered to the client instead of any decode request.
    response: Response | None = None
    prefill_endpoint: str | None = None
    # Sidecar mode: the prefill endpoint stays counted until the decode answer starts.
    lease: Lease | None = None
    # A prefill endpoint was ranked (and, in two-step mode, asked) since the decode pool was:
    # its ranking's snapshots are older than the decode lease.
    ranked_earlier: bool = False

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


class DisaggMetrics:
    def __init__(self, metrics: GatewayMetrics) -> None:
        r = metrics.registry
        self.decisions = Counter(
            "prefixgate_disagg_decision",
            "Disaggregation decisions: decode_only, prefill_decode, or no_prefiller (wanted, "
            "but no prefill endpoint was eligible).",
            ["decision"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "prefixgate_disagg_prefill_seconds",
            "Two-step prefill requests: from sending to the prefill endpoint's full answer.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "prefixgate_disagg_fallbacks",
            "Prefill steps that failed (5xx, timeout, transport, bad_response) and fell back to "
            "a plain decode request.",
            ["reason"],
            registry=r,
        )


class Disaggregator:
    """Runs the decider and, when it says so, the prefill step of one request."""

    def __init__(
        self,
        settings: DisaggregationConfig,
        router: Router,
        profile: SchedulingProfile,
        metrics: GatewayMetrics,
        prefill_timeout: float,
        decider: PrefillDecider | None = None,
    ) -> None:
        self.settings = settings
        self.decider = decider or UncachedTokensDecider(
            settings.non_cached_tokens, router.uncached_tokens
        )
        self.metrics = DisaggMetrics(metrics)
        self._router = router
        self._profile = profile
        self._timeout = prefill_timeout

    async def choose_prefiller(
        self, routing: RoutingRequest, decode: EndpointSnapshot
    ) -> tuple[RoutingRequest, EndpointSnapshot] | None:
        """The prefill endpoint (and the request as ranked for it), or None: decode alone.

        The prefill pool is ranked on a copy of the request, so that the decode pool's prefix
        hits (which its lease and retries still need) are not overwritten by the prefill pool's.
        """
        decisions = self.metrics.decisions
        if routing.api not in SPLIT_APIS or not self.decider.needs_prefill(routing, decode):
            decisions.labels("decode_only").inc()
            return None
        # The request stays unplaced for flow control (whose room is the decode pool's)
        # until its decode lease: the prefill lease does not tell its ticket. Nor does its
        # pick place the session (affinity, live sessions): the session's home is its decode
        # endpoint, whichever pick a front door records last.
        prefill_routing = replace(routing, prefix_hits={}, on_lease=None, prefill_step=True)
        try:
            ranked = await self._router.rank(
                prefill_routing, lambda c: c.id != decode.id, profile=self._profile
            )
        except NoEndpointsError:
            decisions.labels("no_prefiller").inc()
            return None
        decisions.labels("prefill_decode").inc()
        return prefill_routing, ranked[0]

    async def prepare(
        self,
        parsed: ParsedRequest,
        routing: RoutingRequest,
        decode_ranked: Sequence[EndpointSnapshot],
        post: PrefillPost,
        failed: PrefillFailed,
    ) -> DecodeStep:
        """Decide and, in two-step mode, run the prefill request; what decode gets next.

        When the decode endpoint is to pull the KV, ``routing`` says so (``remote_prefill``):
        its decode lease then counts no prefill there, nor teaches what one costs."""
        if wants_prompt_logprobs(parsed.api, parsed.payload):
            self.metrics.decisions.labels("decode_only").inc()
            return DecodeStep(parsed)
        chosen = await self.choose_prefiller(routing, decode_ranked[0])
        if chosen is None:
            return DecodeStep(parsed)
        prefill_routing, endpoint = chosen
        try:
            lease = self._router.lease(prefill_routing, endpoint)
        except KeyError:  # it left the pool while the prefill pool was ranked: decode alone
            return DecodeStep(parsed, ranked_earlier=True)
        self._router.picked(prefill_routing, endpoint.id)
        if self.settings.mode == "sidecar":
            step = DecodeStep(
                parsed, [(PREFILLER_HEADER, endpoint.id)], prefill_endpoint=endpoint.id, lease=lease
            )
        else:
            try:
                step = await self._two_step(
                    parsed, routing.request_id, endpoint, lease, post, failed
                )
            finally:
                lease.release()
        step.ranked_earlier = True
        routing.remote_prefill = step.response is None and step.prefill_endpoint is not None
        return step

    async def _two_step(
        self,
        parsed: ParsedRequest,
        request_id: str,
        endpoint: EndpointSnapshot,
        lease: Lease,
        post: PrefillPost,
        failed: PrefillFailed,
    ) -> DecodeStep:
        path = "/v1/chat/completions" if parsed.api == "chat" else "/v1/completions"
        body = orjson.dumps(prefill_payload(parsed.payload))
        started = time.perf_counter()
        reply: UpstreamReply | None = None
        try:
            async with asyncio.timeout(self._timeout):
                reply = await post(endpoint, path, body)
                if reply.status < 400:
                    # Its answer comes with its one token: the time of the prefill, which
                    # teaches the router the endpoint's price (an error's time tells nothing).
                    lease.first_byte()
                answer = await reply.read_all(_MAX_PREFILL_ANSWER)
            status, content_type = reply.status, reply.content_type
        except UPSTREAM_ERRORS as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else "transport"
            log.warning("request %s: prefill %s on %s: %r", request_id, kind, endpoint.id, exc)
            return self._fall_back(parsed, lease, endpoint, kind, failed)
        finally:
            if reply is not None:
                reply.close()
        self.metrics.prefill_seconds.observe(time.perf_counter() - started)
        if status >= 500:
            return self._fall_back(parsed, lease, endpoint, "5xx", failed)
        lease.upstream_ok()
        if status >= 400:
            response = _passthrough(status, content_type, answer, endpoint.id, request_id)
            return DecodeStep(parsed, response=response, prefill_endpoint=endpoint.id)
        params = kv_params_of(answer) if status < 300 else None
        if params is None:
            log.warning("request %s: prefill answer of %s has no kv_transfer_params",
                        request_id, endpoint.id)
            self.metrics.fallbacks.labels("bad_response").inc()
            return DecodeStep(parsed)
        payload = decode_payload(parsed.payload, params)
        decode = replace(parsed, body=orjson.dumps(payload), decoded=payload)
        return DecodeStep(decode, prefill_endpoint=endpoint.id)

    def _fall_back(
        self, parsed: ParsedRequest, lease: Lease, endpoint: EndpointSnapshot, kind: str,
        failed: PrefillFailed,
    ) -> DecodeStep:
        failed(lease, endpoint.id, kind)
        self.metrics.fallbacks.labels(kind).inc()
        return DecodeStep(parsed)


def _passthrough(
    status: int, content_type: str, body: bytes, endpoint_id: str, request_id: str
) -> Response:
    headers = {"x-gateway-destination-endpoint": endpoint_id, "x-request-id": request_id}
    return Response(body, status, headers, media_type=content_type or "application/json")


def build_disagg_profiles(
    plugins: list[PluginConfig],
    profiles: Sequence[ProfileConfig],
    registry: PluginRegistry,
    context: PluginContext,
) -> tuple[SchedulingProfile, SchedulingProfile]:
    """The decode and prefill profiles, each narrowed to its role pool.

    Explicit ``schedulingProfiles`` name them ``decode`` and ``prefill`` (the config insists);
    a built-in strategy's single profile serves for both.
    """
    where = {p.name: i for i, p in enumerate(profiles)}
    built: list[SchedulingProfile] = []
    pools = ((DECODE_PROFILE, decode_filter()), (PREFILL_PROFILE, prefill_filter()))
    for name, role_filter in pools:
        i = where.get(name, 0)
        profile = build_profile(plugins, profiles[i], registry, context, f"schedulingProfiles[{i}]")
        profile.filters.insert(0, role_filter)
        built.append(profile)
    return built[0], built[1]
