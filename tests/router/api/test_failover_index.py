"""Through the HTTP path: a request whose first pick fails before its first byte leaves the
prefix index crediting only the endpoint that served it (docs/reliability.md)."""

from __future__ import annotations

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.protocol.parsing import parse_request
from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream, replica_routes, serve_app
from tests.gateways import MODEL, gateway_config

PROMPT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me more " * 400}]}


def refusing_replica(refused: list[bytes]) -> Starlette:
    """A replica in the pool (healthy, serving the model) that answers every completion with
    a 500 before producing anything."""

    async def refuse(request: Request) -> Response:
        refused.append(await request.body())
        error = {"error": {"message": "engine dead", "type": "InternalServerError"}}
        return Response(orjson.dumps(error), 500, media_type="application/json")

    return Starlette(
        routes=[Route("/v1/chat/completions", refuse, methods=["POST"]), *replica_routes()]
    )


async def test_after_failover_only_the_serving_endpoint_holds_the_prompts_new_blocks() -> None:
    refused: list[bytes] = []
    async with serve_app(refusing_replica(refused)) as bad_url, echo_upstream() as good:
        config = gateway_config([bad_url, good.url])
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            gateway = gw.gateway
            index, affinity = gateway.stores.index, gateway.stores.affinity
            assert isinstance(index, InMemoryPrefixIndex)
            assert isinstance(affinity, InMemoryAffinityStore)
            ids = {state.endpoint.url: state.endpoint.id for state in gateway.pool}
            bad, ok = ids[bad_url], ids[good.url]
            for state in gateway.pool:
                state.healthy = True
            body = orjson.dumps(PROMPT)
            hashes = gateway.router.routing_request(
                parse_request("chat", body), {}, "probe"
            ).block_hashes
            assert len(hashes) >= 4
            # The refusing replica holds the prompt's head (a shared system prompt, say): it
            # is the first pick, and keeps that head whatever happens to this request.
            held = len(hashes) // 2
            index.record(bad, hashes[:held])
            reply = await http.post(
                "/v1/chat/completions", content=body, headers={"x-session-id": "s"}
            )
            assert reply.status_code == 200
            assert len(refused) == 1, "the first pick was the refusing replica"
            assert len(good.bodies) == 1, "and the request failed over to the other"
            everything = len(hashes)
            assert index.match_now(hashes, [bad, ok]) == {bad: held, ok: everything}, (
                "the refused endpoint is credited with the blocks it never prefilled"
            )
            assert affinity.get_now("s") == ok


async def test_a_request_every_replica_refused_leaves_the_sessions_affinity_as_it_was() -> None:
    """Every attempt failed before its first byte: the session is not pinned to the first pick
    (an endpoint that served nothing); it keeps the endpoint it had, or none."""
    refused: list[bytes] = []
    async with (
        serve_app(refusing_replica(refused)) as one,
        serve_app(refusing_replica(refused)) as two,
        running_gateway(gateway_config([one, two])) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        affinity = gw.gateway.stores.affinity
        assert isinstance(affinity, InMemoryAffinityStore)
        for state in gw.gateway.pool:
            state.healthy = True
        body = orjson.dumps(PROMPT)
        affinity.set("known", "10.0.0.9:8000")  # its last turn's endpoint (since gone)
        for session in ("new", "known"):
            reply = await http.post(
                "/v1/chat/completions", content=body, headers={"x-session-id": session}
            )
            assert reply.status_code == 500
            assert "error" in reply.json()
        assert len(refused) == 4, "each request was sent to both replicas"
        assert affinity.get_now("new") is None
        assert affinity.get_now("known") == "10.0.0.9:8000"
