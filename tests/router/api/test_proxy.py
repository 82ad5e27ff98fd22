from __future__ import annotations

import threading
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream, replica_routes, serve_app
from tests.gateways import MODEL, Parses, gateway_config, learned_first_tokens


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


LARGE = orjson.dumps(_chat("x y " * 300_000))


async def test_a_large_body_is_parsed_and_hashed_in_the_body_parsers_process(
    parses: Parses,
) -> None:
    loop_thread = threading.current_thread()  # the in-process gateway shares this loop
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "offloadBodyBytes": 4096})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            small = await http.post("/v1/chat/completions", json=_chat("hello"))
            # Over a MiB: joined in a thread, parsed in the pool, written upstream in slices.
            large = await http.post("/v1/chat/completions", content=LARGE)
            parser = gw.gateway.proxy.preparer.parser
            assert parser is not None and parser.digested == 1, "the large body, in the pool"
    assert (small.status_code, large.status_code) == (200, 200)
    assert parses == [(small_size := parses[0][0], loop_thread)] and small_size < 4096
    assert echo.bodies[-1] == LARGE, "forwarded unchanged"


async def test_without_parser_processes_a_large_body_is_parsed_in_a_thread(
    parses: Parses,
) -> None:
    async with echo_upstream() as echo:
        server = {"port": 0, "offloadBodyBytes": 4096, "offloadProcesses": 0}
        config = gateway_config([echo.url], server=server)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            large = await http.post("/v1/chat/completions", json=_chat("x" * 8192))
            assert gw.gateway.proxy.preparer.parser is None
    assert large.status_code == 200
    assert parses.threads and parses.threads[0] is not threading.current_thread()


async def test_a_clients_kv_transfer_params_never_reach_a_replica() -> None:
    """They steer a replica's KV connector (which host it pulls from): the gateway's to set."""
    steer = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}
    small = {**_chat("hello"), "kv_transfer_params": steer}
    large = {**_chat("x y " * 300_000), "kv_transfer_params": steer}
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "offloadBodyBytes": 4096})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            for payload in (small, large):
                answer = await http.post("/v1/chat/completions", content=orjson.dumps(payload))
                assert answer.status_code == 200
            parser = gw.gateway.proxy.preparer.parser
            assert parser is not None and parser.digested == 1, "the large body, in the pool"
    forwarded = [orjson.loads(b) for b in echo.bodies[-2:]]
    assert forwarded == [_chat("hello"), _chat("x y " * 300_000)]


async def test_an_error_reply_is_no_first_token_to_learn_from() -> None:
    """A replica refusing a streamed request (a 400 for a prompt over its context, a 5xx on the
    last attempt) answers at once, before any prefill: timed as a first token, it would read
    as a fast prefill, and each one sent at the learned concurrency limit would grow that
    limit. The picker (router/extproc/answer.py) times only a 200's first body chunk."""

    async def refuse(request: Request) -> Response:
        await request.body()
        error = {"error": {"message": "prompt too long", "type": "BadRequestError"}}
        return Response(orjson.dumps(error), 400, media_type="application/json")

    app = Starlette(
        routes=[Route("/v1/chat/completions", refuse, methods=["POST"]), *replica_routes()]
    )
    flow = {"saturationDetector": {"concurrencyLimit": {"initialLimit": 1, "maxLimit": 8}}}
    async with serve_app(app) as url:
        config = gateway_config([url], flowControl=flow)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            learned = learned_first_tokens(gw.gateway.calibrator)
            limits = gw.gateway.flow.limits
            assert limits is not None
            for _ in range(3):
                reply = await http.post(
                    "/v1/chat/completions", json={**_chat("hello"), "stream": True}
                )
                assert reply.status_code == 400
            assert gw.gateway.flow.outstanding(MODEL) == 0
            assert dict(limits.items()) == {}, "an error reply grew the learned limit"
            assert learned == []


async def test_a_request_the_gateway_refuses_still_carries_its_request_id() -> None:
    """Every answer returns the request's ``x-request-id`` (docs/reliability.md), a refusal
    too: it is the id the access log records the refusal under, the one a client quotes."""
    async with echo_upstream() as echo:
        config = gateway_config([echo.url])
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            unknown = await http.post(
                "/v1/chat/completions", json={**_chat("hi"), "model": "nope"},
                headers={"x-request-id": "req-unknown-model"},
            )
            malformed = await http.post(
                "/v1/messages", content=b"{oops", headers={"x-request-id": "req-messages"}
            )
            stored = await http.get(
                "/v1/responses/resp_nowhere", headers={"x-request-id": "req-stored"}
            )
            generated = await http.post("/v1/completions", content=b"[1, 2]")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.headers.get("x-request-id") == "req-unknown-model"
    assert malformed.status_code == 400 and malformed.json()["type"] == "error", "Anthropic's"
    assert malformed.headers.get("x-request-id") == "req-messages"
    assert stored.status_code == 404
    assert stored.json()["error"]["code"] == "response_not_found"
    assert stored.headers.get("x-request-id") == "req-stored"
    assert generated.status_code == 400 and generated.headers.get("x-request-id")
