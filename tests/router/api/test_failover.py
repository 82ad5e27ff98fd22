"""Failover across the ranked endpoints: which are tried, which answer is the client's, and
which picks the index and session affinity learn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from router.api.attempt import Attempt
from router.app import Gateway, build_gateway
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot
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
    assert index.match_now(routing.block_hashes, [b]) == {b: len(routing.block_hashes)}
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
    assert affinity.get_now("s") == a


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
