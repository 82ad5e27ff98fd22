"""Failover across the ranked endpoints: which are tried, which answer is the client's, and
which picks the index and session affinity learn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
import pytest

from router.api.attempt import Attempt
from router.app import Gateway, build_gateway
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot
from router.core.errors import UpstreamError
from router.core.framework import RoutingRequest
from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.protocol.exchange import Exchange
from router.protocol.parsing import parse_request

A, B = "http://127.0.0.1:9", "http://127.0.0.1:10"
SESSION = {"x-session-id": "s"}
BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "tell me more " * 200}]}
)


@dataclass
class Reply:
    """An upstream answer's status line, as the failover reads it."""

    status: int
    closed: bool = False

    def close(self) -> None:
        self.closed = True


Outcome = int | BaseException  # an answer's status, or what sending raises


def upstreams(outcomes: dict[str, Outcome]) -> tuple[list[str], Callable[..., Any]]:
    """A send that answers each endpoint as ``outcomes`` says; the endpoints it was sent to."""
    sent: list[str] = []

    async def send(endpoint: EndpointSnapshot) -> Attempt:
        sent.append(endpoint.id)
        outcome = outcomes[endpoint.id]
        if isinstance(outcome, BaseException):
            raise outcome
        return Attempt(Reply(outcome), b"{}")  # type: ignore[arg-type]

    return sent, send


def gateway(max_attempts: int = 3, **overrides: Any) -> Gateway:
    endpoints = [{"url": url, "models": ["m"]} for url in (A, B)]
    config = {"pool": {"endpoints": endpoints}, "proxy": {"maxAttempts": max_attempts}}
    gw = build_gateway(parse_config({**config, **overrides}))
    for state in gw.pool:
        state.healthy = True
    return gw


def request(gw: Gateway) -> RoutingRequest:
    return gw.router.routing_request(parse_request("chat", BODY), SESSION, "r")


def stores(gw: Gateway) -> tuple[InMemoryPrefixIndex, InMemoryAffinityStore]:
    index, affinity = gw.stores.index, gw.stores.affinity
    assert isinstance(index, InMemoryPrefixIndex)
    assert isinstance(affinity, InMemoryAffinityStore)
    return index, affinity


def ranked(gw: Gateway, *ids: str) -> list[EndpointSnapshot]:
    by_id = {c.id: c for c in gw.pool.candidates("m")}
    return [by_id[i] for i in ids]


async def failover(
    gw: Gateway, routing: RoutingRequest, outcomes: dict[str, Outcome]
) -> tuple[list[str], str]:
    """The request through the proxy's failover, to the endpoints in the order ``outcomes``
    names them; where it was sent and which one answered."""
    sent, send = upstreams(outcomes)
    answered = await gw.proxy.failover.first_answer(
        routing, ranked(gw, *outcomes), send, Exchange("chat", "r", 0.0)
    )
    answered.lease.release()
    return sent, answered.endpoint.id


def ids(gw: Gateway) -> tuple[str, str]:
    a, b = (c.id for c in gw.pool.candidates("m"))
    return a, b


@pytest.mark.parametrize(
    "failure",
    [ConnectionRefusedError("refused"), TimeoutError("no first byte"), 503],
    ids=["connect-error", "timeout", "5xx"],
)
async def test_a_failed_attempt_moves_on_and_the_retry_is_recorded_where_served(
    failure: Outcome,
) -> None:
    gw = gateway()
    a, b = ids(gw)
    index, affinity = stores(gw)
    routing = request(gw)
    sent, served = await failover(gw, routing, {a: failure, b: 200})
    assert (sent, served) == ([a, b], b)
    everything = len(routing.block_hashes)
    assert index.match_now(routing.block_hashes, [a, b]) == {a: 0, b: everything}, (
        "the failed first pick's record is withdrawn: it prefilled nothing"
    )
    assert affinity.get_now("s") == b, "the session goes where it was served"


async def test_a_4xx_is_the_clients_answer_and_nothing_is_retried() -> None:
    gw = gateway()
    a, b = ids(gw)
    sent, served = await failover(gw, request(gw), {a: 404, b: 200})
    assert (sent, served) == ([a], a)


async def test_the_last_attempts_5xx_is_the_answer_and_not_recorded_as_a_pick() -> None:
    """A retry is recorded once its endpoint has answered: a 5xx is no answer to learn from
    (the first attempt's pick was recorded before it was sent, as every first pick is)."""
    gw = gateway()
    a, b = ids(gw)
    index, affinity = stores(gw)
    routing = request(gw)
    sent, served = await failover(gw, routing, {a: ConnectionRefusedError("refused"), b: 500})
    assert (sent, served) == ([a, b], b)
    assert index.match_now(routing.block_hashes, [b]) == {b: 0}
    # It used to stay on the first pick, which served nothing: the session's next request was
    # pinned to a failing endpoint. The failed pick is undone, as in the prefix index.
    assert affinity.get_now("s") is None, "the session had no endpoint before: none now"


async def test_a_request_no_endpoint_served_leaves_the_sessions_previous_endpoint() -> None:
    gw = gateway()
    a, b = ids(gw)
    _, affinity = stores(gw)
    affinity.set("s", b)  # where the session's previous request was served
    routing = request(gw)
    await gw.router.rank(routing)  # its producers read the session's endpoint, as a request's do
    with pytest.raises(UpstreamError):
        await failover(gw, routing, {a: ConnectionRefusedError("refused")})
    assert affinity.get_now("s") == b
    routing = request(gw)
    await gw.router.rank(routing)
    sent, served = await failover(gw, routing, {a: 503, b: 503})
    assert (sent, served) == ([a, b], b)
    assert affinity.get_now("s") == b


async def test_attempts_are_bounded_by_max_attempts() -> None:
    gw = gateway(max_attempts=1)
    a, b = ids(gw)
    sent, served = await failover(gw, request(gw), {a: 500, b: 200})
    assert (sent, served) == ([a], a)


async def test_a_client_gone_before_the_first_byte_is_no_failure_of_the_endpoint() -> None:
    gw = gateway()
    a, b = ids(gw)

    def failures() -> float:
        value = gw.metrics.registry.get_sample_value(
            "prefixgate_upstream_failures_total", {"endpoint": a, "kind": "transport"}
        )
        return value or 0.0

    with pytest.raises(asyncio.CancelledError):
        await failover(gw, request(gw), {a: asyncio.CancelledError(), b: 200})
    assert failures() == 0
    await failover(gw, request(gw), {a: ConnectionResetError("reset"), b: 200})
    assert failures() == 1  # what a failure of the endpoint's counts as


C = "http://127.0.0.1:11"


def three_endpoints(max_attempts: int = 3) -> tuple[Gateway, tuple[str, str, str]]:
    endpoints = [{"url": url, "models": ["m"]} for url in (A, B, C)]
    gw = gateway(max_attempts, pool={"endpoints": endpoints})
    a, b, c = (s.endpoint.id for s in gw.pool)
    return gw, (a, b, c)


async def test_a_retry_skips_an_endpoint_found_down_since_the_ranking() -> None:
    """The first attempt's failure leaves time for the health check (or outlier ejection) to
    take the next ranked endpoint out: the retry goes to one still serving, not to it."""
    gw, (a, b, c) = three_endpoints()
    sent: list[str] = []

    async def send(endpoint: EndpointSnapshot) -> Attempt:
        sent.append(endpoint.id)
        if endpoint.id == a:
            state = gw.pool.get(b)
            assert state is not None
            state.healthy = False  # its health probe failed meanwhile
            raise ConnectionRefusedError("refused")
        return Attempt(Reply(200), b"{}")  # type: ignore[arg-type]

    answered = await gw.proxy.failover.first_answer(
        request(gw), ranked(gw, a, b, c), send, Exchange("chat", "r", 0.0)
    )
    answered.lease.release()
    assert (sent, answered.endpoint.id) == ([a, c], c)


async def test_max_attempts_counts_the_attempts_sent() -> None:
    """An endpoint gone from the pool since the ranking is not tried, and takes no attempt."""
    gw, (a, b, c) = three_endpoints(max_attempts=2)
    routing, candidates = request(gw), ranked(gw, a, b, c)
    gw.pool.remove(b)
    sent, send = upstreams({a: ConnectionRefusedError("refused"), c: 200})
    answered = await gw.proxy.failover.first_answer(
        routing, candidates, send, Exchange("chat", "r", 0.0)
    )
    answered.lease.release()
    assert (sent, answered.endpoint.id) == ([a, c], c)


async def test_a_5xx_is_the_answer_when_no_endpoint_is_left_to_retry_on() -> None:
    """The next ranked endpoint left the pool: the 5xx already in is the client's answer (its
    status and body), not a 502 saying no endpoint could be reached."""
    gw = gateway()
    a, b = ids(gw)
    routing, candidates = request(gw), ranked(gw, a, b)
    gw.pool.remove(b)
    sent, send = upstreams({a: 503})
    answered = await gw.proxy.failover.first_answer(
        routing, candidates, send, Exchange("chat", "r", 0.0)
    )
    reply = cast(Reply, answered.attempt.reply)
    assert (sent, answered.endpoint.id, reply.status, reply.closed) == ([a], a, 503, False)
    state = gw.pool.get(a)
    assert state is not None and state.in_flight == 1, "the answer's lease is still held"
    answered.lease.release()
    assert state.in_flight == 0


async def test_a_5xx_moved_on_from_is_closed_and_its_lease_released() -> None:
    gw = gateway()
    a, b = ids(gw)
    replies: dict[str, Reply] = {}

    async def send(endpoint: EndpointSnapshot) -> Attempt:
        reply = replies[endpoint.id] = Reply(503 if endpoint.id == a else 200)
        return Attempt(reply, b"{}")  # type: ignore[arg-type]

    answered = await gw.proxy.failover.first_answer(
        request(gw), ranked(gw, a, b), send, Exchange("chat", "r", 0.0)
    )
    state = gw.pool.get(a)
    assert state is not None and state.in_flight == 0 and replies[a].closed
    assert answered.endpoint.id == b and not replies[b].closed
    answered.lease.release()
