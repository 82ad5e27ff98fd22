from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import replica_routes, serve_app
from tests.gateways import gateway_config

RESPONSE_ID = "resp_background"


def _holder() -> Starlette:
    """A replica holding one background response: a plain GET finds it (the gateway's probe),
    ``?stream=true`` streams its events, then says nothing more (a replica stuck mid-answer)."""

    async def stalled() -> AsyncIterator[bytes]:
        delta = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "hi"}
        yield b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        await asyncio.Event().wait()  # never set: the gateway's idle timeout ends it

    async def get(request: Request) -> Response:
        if request.query_params.get("stream") == "true":
            return StreamingResponse(stalled(), media_type="text/event-stream")
        body = {"id": RESPONSE_ID, "object": "response", "status": "in_progress"}
        return Response(orjson.dumps(body), media_type="application/json")

    return Starlette(routes=[Route("/v1/responses/{response_id}", get), *replica_routes()])


async def test_a_stored_responses_stream_that_fails_ends_with_a_typed_error_event() -> None:
    """``GET /v1/responses/{id}?stream=true`` streams Responses API events: a failure ends it
    with that API's typed ``error`` event, as a ``POST /v1/responses`` stream's does, not
    with chat's untyped ``data: {"error": ...}`` (which a Responses client cannot parse)."""
    async with (
        serve_app(_holder()) as url,
        running_gateway(gateway_config([url], proxy={"idleTimeoutSeconds": 0.3})) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        resp = await http.get(f"/v1/responses/{RESPONSE_ID}", params={"stream": "true"})
    assert resp.status_code == 200
    last = resp.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: "), last
    error = orjson.loads(last.removeprefix("event: error\ndata: "))
    assert error["type"] == "error" and "idle timeout" in error["message"]
