"""Disaggregated prefill and decode, one request's steps on a gateway built but not started
(no sockets: a prefill endpoint's answer is handed to the step as the upstream client would):
what is decided, what each pool counts, what is learned."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.app import Gateway, build_gateway
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.protocol.parsing import Api, ParsedRequest, parse_request
from router.scheduling.disagg import PREFILLER_HEADER, DecodeStep
from router.scheduling.routing import Router

LONG = " ".join(f"word{i}" for i in range(1000))
LONG_MESSAGE = {"role": "user", "content": LONG}
PREFILLER, DECODER = "127.0.0.1:1", "127.0.0.1:2"


def split_gateway(pool: dict[str, Any] | None = None, **disagg: Any) -> Gateway:
    """A gateway built (not started) over one healthy prefill and one healthy decode endpoint,
    PREFILLER and DECODER, serving model ``m``, with disaggregation on (``disagg``: more of
    its keys; ``pool``: more pool keys)."""
    endpoints = [
        {"url": f"http://{PREFILLER}", "role": "prefill", "models": ["m"]},
        {"url": f"http://{DECODER}", "role": "decode", "models": ["m"]},
    ]
    gw = build_gateway(parse_config({
        "pool": {"endpoints": endpoints, **(pool or {})},
        "disaggregation": {"enabled": True, **disagg},
    }))
    for state in gw.pool:
        state.healthy = True
    return gw


def decode_of(gw: Gateway) -> EndpointSnapshot:
    return next(c for c in gw.pool.candidates("m") if c.role == "decode")


async def prepare(
    gw: Gateway, parsed: ParsedRequest, routing: RoutingRequest, post: Any
) -> DecodeStep:
    """The proxy's call of the prefill step (router/api/proxy.py), decode pick and all."""
    disagg = gw.proxy.disagg
    assert disagg is not None
    return await disagg.prepare(parsed, routing, [decode_of(gw)], post, gw.proxy.failover.failed)


class PrefillReply:
    """A prefill endpoint's whole answer, as the upstream client hands it over."""

    content_type = "application/json"

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self._body = status, body

    async def read_all(self, limit: int = 1 << 20) -> bytes:
        return self._body[:limit]

    def close(self) -> None:
        pass


HANDED_OVER = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 9}


def answering(status: int = 200, posted: list[str] | None = None) -> Any:
    """A prefill ``post`` whose endpoint answers ``status`` (200: with kv_transfer_params)."""
    params = HANDED_OVER if status < 300 else None
    body = orjson.dumps({"choices": [], "kv_transfer_params": params})

    async def post(endpoint: EndpointSnapshot, path: str, sent: bytes) -> Any:
        if posted is not None:
            posted.append(endpoint.id)
        return PrefillReply(status, body)

    return post


def long_request(api: Api = "chat", **fields: Any) -> tuple[ParsedRequest, RoutingRequest]:
    """A body of ``api`` with a long prompt (and ``fields``), and its routing request: 5,000
    prompt tokens, none of them cached anywhere."""
    prompt: dict[str, Any] = {"messages": [LONG_MESSAGE]} if api == "chat" else {"prompt": LONG}
    payload = {"model": "m", **prompt, **fields}
    parsed = parse_request(api, orjson.dumps(payload))
    stream = bool(fields.get("stream"))
    return parsed, RoutingRequest("r", "m", api=api, stream=stream, prompt_tokens=5_000)


def learned(gw: Gateway, endpoint_id: str) -> bool:
    """Whether the calibrator has learned a first-token price of the endpoint's own."""
    value = gw.metrics.registry.get_sample_value(
        "prefixgate_calibrated_prefill_overhead_seconds", {"endpoint": endpoint_id}
    )
    return value is not None


async def test_a_request_in_its_prefill_step_is_unplaced_until_its_decode_lease() -> None:
    """Flow control's room is the decode pool's: a request whose prefill runs elsewhere must
    still count against it, or a burst of long prompts passes at once."""
    gw = split_gateway()
    assert gw.proxy.disagg is not None
    told: list[str] = []
    routing = RoutingRequest("r", "m", api="chat", prompt_tokens=5_000)
    routing.on_lease = lambda: told.append("leased")
    decode = next(c for c in gw.pool.candidates("m") if c.role == "decode")
    chosen = await gw.proxy.disagg.choose_prefiller(routing, decode)
    assert chosen is not None
    prefill_routing, prefill = chosen
    gw.router.lease(prefill_routing, prefill).release()
    assert told == []
    gw.router.lease(routing, decode).release()
    assert told == ["leased"]


async def test_a_prefill_endpoint_that_left_while_ranked_means_a_plain_decode_request() -> None:
    """The prefill pool is ranked across awaits (index, affinity, Redis): its pick may leave
    the pool meanwhile (discovery), as a decode pick may (which failover skips). Its lease then
    cannot be taken: the request goes to decode alone rather than failing."""
    gw = split_gateway()
    disagg = gw.proxy.disagg
    assert disagg is not None
    rank = gw.router.rank

    async def rank_while_the_prefiller_leaves(*args: Any, **kwargs: Any) -> list[EndpointSnapshot]:
        ranked = await rank(*args, **kwargs)
        gw.pool.remove("127.0.0.1:1")  # discovery saw it go during the ranking's awaits
        return ranked

    gw.router.rank = rank_while_the_prefiller_leaves  # type: ignore[method-assign]
    posted: list[str] = []

    async def post(endpoint: EndpointSnapshot, path: str, body: bytes) -> Any:
        posted.append(endpoint.id)
        raise AssertionError("no prefill request to an endpoint out of the pool")

    parsed = parse_request("chat", orjson.dumps({"model": "m", "messages": [LONG_MESSAGE]}))
    routing = RoutingRequest("r", "m", api="chat", prompt_tokens=5_000)
    step = await prepare(gw, parsed, routing, post)
    assert step.parsed is parsed and step.response is None and step.lease is None
    assert posted == [] and all(s.in_flight == 0 for s in gw.pool)




async def test_a_prefill_step_does_not_place_the_session_nor_count_as_its_request() -> None:
    """A session's home is its decode endpoint: the prefill pick is learned by the prefix
    index (both pools' picks are), not by the session's affinity nor its live-session count,
    whichever pick a front door records last (ext_proc records the decode pick first). One
    disaggregated request is one request of its session, so the session is not live yet."""
    gw = split_gateway()
    disagg = gw.proxy.disagg
    assert disagg is not None
    routing = RoutingRequest("r", "m", api="chat", prompt_tokens=5_000, session_id="s")
    decode = next(c for c in gw.pool.candidates("m") if c.role == "decode")
    gw.router.picked(routing, decode.id)  # ext_proc's order: the decode pick first
    chosen = await disagg.choose_prefiller(routing, decode)
    assert chosen is not None
    prefill_routing, prefill = chosen
    gw.router.picked(prefill_routing, prefill.id)
    assert await gw.stores.affinity.get("s") == decode.id
    assert gw.metrics.registry.get_sample_value("prefixgate_live_sessions") == 0


async def test_the_decider_counts_the_decode_picks_cache_as_the_router_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router's count of a request's uncached tokens (``Router.uncached_tokens``) is the
    one queues and prices use; precise routing overrides it with what the replicas' KV events
    say they hold. A prompt the decode pick holds by that count is computed there, whatever
    the approximate index's hits on the request (none here) say."""
    monkeypatch.setattr(Router, "uncached_tokens", lambda self, routing, endpoint_id: 1)
    gw = split_gateway()
    assert gw.proxy.disagg is not None
    routing = RoutingRequest("r", "m", api="chat", prompt_tokens=5_000)
    assert await gw.proxy.disagg.choose_prefiller(routing, decode_of(gw)) is None
    decisions = "prefixgate_disagg_decision_total"
    assert metric_of(gw, decisions, {"decision": "decode_only"}) == 1


@pytest.mark.parametrize(
    ("api", "fields", "split"),
    [
        ("chat", {"prompt_logprobs": 0}, False),
        ("completions", {"prompt_logprobs": 5}, False),
        ("completions", {"echo": True, "logprobs": 1}, False),
        ("completions", {"echo": True}, True),  # the prompt's text only: decode has it
        ("completions", {"logprobs": 1}, True),  # the generated tokens' only
        ("chat", {"logprobs": True, "top_logprobs": 2}, True),
    ],
)
async def test_a_request_for_its_prompts_logprobs_is_not_split(
    api: Api, fields: dict[str, Any], split: bool
) -> None:
    """A decode endpoint that pulls the prompt's KV never computes the prompt's logits: vLLM's
    decode fails on a request asking for prompt logprobs. Such a request is computed where it
    is decoded; logprobs of the generated tokens are the decode endpoint's anyway."""
    gw = split_gateway()
    posted: list[str] = []
    parsed, routing = long_request(api, **fields)
    step = await prepare(gw, parsed, routing, answering(200, posted))
    assert (posted == [PREFILLER]) is split
    assert ("kv_transfer_params" in step.parsed.payload) is split
    assert routing.remote_prefill is split
    decisions = "prefixgate_disagg_decision_total"
    assert metric_of(gw, decisions, {"decision": "decode_only"}) == (0 if split else 1)


@pytest.mark.parametrize("stream", [True, False])
async def test_after_a_prefill_step_the_decode_endpoint_counts_no_prefill(stream: bool) -> None:
    """The decode endpoint pulls the KV the prefill endpoint computed: its prefill queue (what
    the cost scorer and flow control read) must not grow by the prompt, nor may its first
    byte, a KV pull, teach the calibrator the price of a prefill it did not compute. The
    prefill endpoint's answer comes with its one token: that teaches a prefill price."""
    gw = split_gateway()
    parsed, routing = long_request("chat", stream=stream)
    step = await prepare(gw, parsed, routing, answering(200))
    assert step.prefill_endpoint == PREFILLER
    assert step.parsed.payload["kv_transfer_params"] == HANDED_OVER
    assert learned(gw, PREFILLER)
    decode = gw.pool.get(DECODER)
    assert decode is not None
    lease = gw.router.lease(routing, decode_of(gw))
    assert (decode.pending_prefill_tokens, decode.pending_prefill_requests) == (1, 1)
    lease.first_byte()
    lease.release()
    assert not learned(gw, DECODER)
    assert all(s.in_flight == 0 and s.pending_prefill_tokens == 0 for s in gw.pool)


async def test_in_sidecar_mode_the_decode_endpoint_counts_no_prefill_either() -> None:
    """The sidecar next to the decode endpoint runs the prefill on the named prefiller: the
    decode endpoint's queue is not the prompt's, its first byte not its prefill's."""
    gw = split_gateway(mode="sidecar")
    parsed, routing = long_request("chat", stream=True)
    step = await prepare(gw, parsed, routing, answering(500))  # never called: no prefill here
    assert step.headers == [(PREFILLER_HEADER, PREFILLER)]
    decode = gw.pool.get(DECODER)
    assert decode is not None
    lease = gw.router.lease(routing, decode_of(gw))
    assert decode.pending_prefill_tokens == 1
    lease.first_byte()
    lease.release()
    step.release()
    assert not learned(gw, DECODER)
    assert all(s.in_flight == 0 for s in gw.pool)


@pytest.mark.parametrize("status", [400, 503])
async def test_a_failed_prefill_step_leaves_decode_to_compute_the_prompt(status: int) -> None:
    """A 4xx goes back to the client, a 5xx falls back to a plain decode request: either way
    no KV was handed over, and a decode request computes the whole prompt."""
    gw = split_gateway()
    parsed, routing = long_request("chat")
    step = await prepare(gw, parsed, routing, answering(status))
    assert (step.response is not None) is (status < 500)
    assert step.parsed is parsed and not routing.remote_prefill
    assert not learned(gw, PREFILLER)  # an error's time is no prefill's


async def test_a_prefill_endpoint_ejected_by_its_failures_is_counted_as_ejected() -> None:
    """Failed prefill requests count towards the endpoint's outlier ejection as any failed
    attempt does, and an ejection they cause shows in prefixgate_endpoint_ejections like any
    other (operators alert on it)."""
    gw = split_gateway(pool={"outlierDetection": {"consecutiveFailures": 1}})
    parsed, routing = long_request("chat")
    step = await prepare(gw, parsed, routing, answering(503))
    assert step.parsed is parsed
    prefiller = gw.pool.get(PREFILLER)
    assert prefiller is not None and prefiller.ejected
    ejections = "prefixgate_endpoint_ejections_total"
    assert metric_of(gw, ejections, {"endpoint": PREFILLER}) == 1
    failures = "prefixgate_upstream_failures_total"
    assert metric_of(gw, failures, {"endpoint": PREFILLER, "kind": "5xx"}) == 1


def metric_of(gw: Gateway, name: str, labels: dict[str, str]) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0
