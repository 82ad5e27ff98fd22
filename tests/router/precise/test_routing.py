"""Precise routing's per-request state (router/precise/routing.py)."""

from __future__ import annotations

import orjson

from router.app import build_gateway
from router.protocol.parsing import parse_request
from tests.gateways import MODEL, gateway_config


def test_requests_that_share_a_client_request_id_keep_their_own_state() -> None:
    """A client's x-request-id need not be unique (retries, a constant in a script): each
    request's tokens and scores stay its own, and finishing one leaves the other."""
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    gateway = build_gateway(gateway_config([], pool={"endpoints": [endpoint]}, strategy="precise"))
    assert gateway.precise is not None
    tracker = gateway.precise.tracker
    routings = []
    for prompt in ("the first prompt", "the second prompt"):
        parsed = parse_request("completions", orjson.dumps({"model": MODEL, "prompt": prompt}))
        routings.append(gateway.router.routing_request(parsed, {}, "same"))
    first, second = routings
    assert first.serial != second.serial
    for routing, prompt in zip(routings, ("the first prompt", "the second prompt"), strict=True):
        state = tracker.state(routing.serial)
        assert state is not None and state.source is not None
        assert state.source.payload["prompt"] == prompt
    assert tracker.finish(first.serial) is not None
    assert tracker.state(second.serial) is not None


def test_a_follow_up_to_a_stored_response_gets_no_precise_state() -> None:
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    gateway = build_gateway(gateway_config([], pool={"endpoints": [endpoint]}, strategy="precise"))
    assert gateway.precise is not None
    body = {"model": MODEL, "input": "go on", "previous_response_id": "resp_1"}
    parsed = parse_request("responses", orjson.dumps(body))
    routing = gateway.router.routing_request(parsed, {}, "r")
    assert gateway.precise.tracker.state(routing.serial) is None
