"""The OpenAI Responses API end to end: the openai SDK through the gateway to simulated replicas,
follow-ups on the replica that stored the response, shared routes, errors and prefix reuse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from benchmarks.agent_reuse import agentic_sessions, captured_share
from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.serve.server import RunningGateway, running_gateway
from tests.e2e.test_reliability_support import replica_routes, serve_app
from tests.gateways import MODEL, gateway_config, learned_first_tokens
from tests.router.protocol.test_responses_api import DESTINATION

# -- end to end through the openai SDK ------------------------------------------------------------


@pytest.fixture
async def oai(gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0) as c:
        yield c


async def follow(
    oai: openai.AsyncOpenAI, previous: str | None, text: str, stream: bool
) -> tuple[str, str]:
    """(response id, endpoint that served it) of one turn."""
    ask: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 6}
    if previous is not None:
        ask["previous_response_id"] = previous
    if stream:
        raw_stream = await oai.responses.with_raw_response.create(**ask, stream=True)
        kinds, completed = [], None
        async for event in raw_stream.parse():
            kinds.append(event.type)
            if event.type == "response.completed":
                completed = event.response.id
        assert kinds[0] == "response.created" and completed is not None
        return completed, raw_stream.headers[DESTINATION]
    raw = await oai.responses.with_raw_response.create(**ask)
    return raw.parse().id, raw.headers[DESTINATION]


async def test_follow_ups_land_on_the_replica_that_stored_the_response(
    replicas: list[Replica],
) -> None:
    """8 interleaved conversations of 4 turns, streamed and not: every follow-up reaches the
    replica holding its previous response (any other would answer 404), known from the answers
    the gateway relayed (asking the endpoints is off here)."""
    config = gateway_config([r.url for r in replicas], responses={"probeTimeoutSeconds": 0})
    async with (
        running_gateway(config) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as oai,
    ):

        async def conversation(n: int) -> set[str]:
            response_id, home = await follow(oai, None, f"conversation {n} " * 20, n % 2 == 0)
            homes = {home}
            for turn in range(3):
                response_id, where = await follow(oai, response_id, f"turn {turn}", turn % 2 == 1)
                homes.add(where)
            return homes

        results = await asyncio.gather(*(conversation(n) for n in range(8)))
        remembered = len(gw.gateway.stores.responses)
    assert all(len(homes) == 1 for homes in results)
    assert len(set().union(*results)) > 1, "the conversations were spread, not all on one"
    assert remembered == 32


async def test_an_answer_not_stored_is_not_remembered(
    oai: openai.AsyncOpenAI, gateway: RunningGateway
) -> None:
    """Codex sends ``store: false`` with every request: remembering those ids would push
    out the entries of responses that are stored."""
    responses = gateway.gateway.stores.responses
    before = len(responses)
    for stream in (False, True):
        ask: dict[str, Any] = {"model": MODEL, "input": "kept nowhere", "max_output_tokens": 4}
        if stream:
            async for _ in await oai.responses.create(**ask, store=False, stream=True):
                pass
        else:
            await oai.responses.create(**ask, store=False)
    assert len(responses) == before
    await follow(oai, None, "kept", stream=False)
    assert len(responses) == before + 1


async def test_get_delete_and_cancel_go_to_the_holder(
    oai: openai.AsyncOpenAI, gateway: RunningGateway
) -> None:
    response_id, home = await follow(oai, None, "keep this", stream=False)
    raw = await oai.responses.with_raw_response.retrieve(response_id)
    assert raw.headers[DESTINATION] == home and raw.parse().id == response_id
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        # The simulator serves no cancel; what matters is where the gateway sent it.
        cancel = await http.post(f"/v1/responses/{response_id}/cancel")
        assert cancel.headers[DESTINATION] == home
        bad = await http.get("/v1/responses/resp%20bad")
    assert bad.status_code == 404
    await oai.responses.delete(response_id)
    with pytest.raises(openai.NotFoundError) as gone:
        await oai.responses.retrieve(response_id)
    assert gone.value.code == "response_not_found"


async def test_a_gone_endpoint_is_a_clear_4xx_never_another_replicas_answer() -> None:
    health = {"intervalSeconds": 0.05, "unhealthyThreshold": 1, "timeoutSeconds": 0.2}
    async with start_replicas(3, SimConfig(speed=50)) as replicas:
        config = gateway_config([r.url for r in replicas])
        config = config.model_copy(
            update={
                "pool": config.pool.model_copy(
                    update={"health_check": config.pool.health_check.model_copy(update=health)}
                )
            }
        )
        async with (
            running_gateway(config) as gw,
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as oai,
        ):
            first, home = await follow(oai, None, "hello " * 10, stream=False)
            second, _ = await follow(oai, None, "another " * 10, stream=False)
            holder = next(r for r in replicas if r.url.endswith(home))
            holder.server.should_exit = True  # the replica goes down
            state = gw.gateway.pool.get(home)
            async with asyncio.timeout(5):
                while state is not None and state.healthy:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            with pytest.raises(openai.ConflictError) as down:
                await follow(oai, first, "still there?", stream=False)
            assert down.value.code == "response_endpoint_unavailable"
            assert down.value.param == "previous_response_id"
            gw.gateway.pool.remove(home)  # and leaves the pool
            with pytest.raises(openai.NotFoundError) as gone:
                await follow(oai, first, "still there?", stream=True)
            assert gone.value.code == "response_endpoint_gone"
            served = sum(len(r.sim.responses.items) for r in replicas)
    assert served == 2, "no other replica answered the follow-ups"
    assert second


async def test_a_second_gateway_finds_responses_by_asking_the_endpoints(
    replicas: list[Replica],
) -> None:
    urls = [r.url for r in replicas]
    async with (
        running_gateway(gateway_config(urls)) as one,
        running_gateway(gateway_config(urls)) as two,
        openai.AsyncOpenAI(base_url=one.url + "/v1", api_key="k", max_retries=0) as via_one,
        openai.AsyncOpenAI(base_url=two.url + "/v1", api_key="k", max_retries=0) as via_two,
    ):
        first, home = await follow(via_one, None, "hello " * 10, stream=False)
        _, where = await follow(via_two, first, "and then?", stream=True)
    assert where == home


@pytest.mark.redis
async def test_gateways_share_response_routes_through_redis(
    replicas: list[Replica], redis_url: str, redis_namespace: str
) -> None:
    urls = [r.url for r in replicas]
    index = {"backend": "redis", "url": redis_url, "namespace": redis_namespace}
    # Sharing, not budgets: with the default 50 ms, a loaded machine's second gateway gave up
    # on Redis and answered 404. It may not ask the endpoints: it must know from Redis.
    generous = {"redisTimeoutMs": 1000}
    async with (
        running_gateway(gateway_config(urls, prefixIndex=index, responses=generous)) as one,
        running_gateway(
            gateway_config(
                urls, prefixIndex=index, responses={**generous, "probeTimeoutSeconds": 0}
            )
        ) as two,
        openai.AsyncOpenAI(base_url=one.url + "/v1", api_key="k", max_retries=0) as via_one,
        openai.AsyncOpenAI(base_url=two.url + "/v1", api_key="k", max_retries=0) as via_two,
    ):
        for n in range(4):
            first, home = await follow(via_one, None, f"hello {n} " * 10, stream=n % 2 == 0)
            await one.gateway.stores.responses.flush()
            _, where = await follow(via_two, first, "and then?", stream=False)
            assert where == home


async def test_responses_errors_are_openai_shaped(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.responses.create(model=MODEL, input=3)  # type: ignore[arg-type]
    assert bad.value.code == 400 or bad.value.param == "input"
    with pytest.raises(openai.NotFoundError) as unknown:
        await oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert unknown.value.param == "previous_response_id"


class StallingResponses:
    def app(self) -> Starlette:
        async def create(request: Request) -> Response:
            await request.body()
            return StreamingResponse(self._stall(), media_type="text/event-stream")

        async def ok(request: Request) -> Response:
            body = b'{"data": [{"id": "sim-model"}]}' if request.url.path == "/v1/models" else b""
            return Response(body, media_type="application/json")

        routes = [Route("/v1/responses", create, methods=["POST"])]
        routes += [Route(p, ok) for p in ("/health", "/metrics", "/v1/models")]
        return Starlette(routes=routes)

    async def _stall(self) -> AsyncIterator[bytes]:
        created = {
            "type": "response.created",
            "sequence_number": 0,
            "response": {
                "id": "resp_stall",
                "object": "response",
                "status": "in_progress",
                "output": [],
                "model": MODEL,
                "created_at": 0,
            },
        }
        yield b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"
        # A first token, then silence: the idle timeout's to end (before it, the first-byte
        # timeout's, which sends the request elsewhere).
        delta = {"type": "response.output_text.delta", "sequence_number": 1, "delta": "hi"}
        yield b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        await asyncio.sleep(30)


async def test_a_failed_stream_ends_with_a_typed_error_event_and_the_id_is_remembered() -> None:
    async with (
        serve_app(StallingResponses().app()) as url,
        running_gateway(gateway_config([url], proxy={"idleTimeoutSeconds": 0.3})) as gw,
    ):
        async with httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post(
                "/v1/responses", json={"model": MODEL, "input": "x", "stream": True}
            )
        remembered = gw.gateway.stores.responses.local("resp_stall")
    name, data = resp.text.strip().split("\n\n")[-1].split("\n")
    assert name == "event: error"
    error = orjson.loads(data[len("data: ") :])
    assert error["type"] == "error" and "idle timeout" in error["message"]
    assert remembered == url.removeprefix("http://")


# -- prefix reuse ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_full_history_sessions_capture_as_much_prefix_reuse_as_chat() -> None:
    sessions = agentic_sessions(sessions=24, turns=8, seed=1)
    chat, _, chat_reuse = await captured_share("chat", sessions)
    responses, outcome, reuse = await captured_share("responses", sessions)
    print(f"captured share: chat {chat:.3f}, responses {responses:.3f}")
    assert outcome.errors == 0 and reuse.reusable_tokens == chat_reuse.reusable_tokens
    assert responses >= chat - 0.04 and responses >= 0.9


async def test_a_holder_that_never_answers_is_a_504_after_the_first_byte_timeout() -> None:
    """Retrieving a stored response waits on its holder under the first-byte timeout, like any
    request, and the client gets the OpenAI-shaped timeout error, not a hung request."""
    stored = {"id": "resp_held", "object": "response", "status": "completed", "output": []}
    hold = asyncio.Event()

    async def create(request: Request) -> Response:
        return Response(orjson.dumps(stored), media_type="application/json")

    async def retrieve(request: Request) -> Response:
        await hold.wait()  # the holder hangs
        return Response(orjson.dumps(stored), media_type="application/json")

    app = Starlette(routes=[
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        *replica_routes(),
    ])
    try:
        async with serve_app(app) as url:
            config = gateway_config(
                [url], responses={"probeTimeoutSeconds": 0},
                proxy={"firstByteTimeoutSeconds": 0.2},
            )
            async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
                made = await http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
                assert made.status_code == 200 and made.json()["id"] == "resp_held", made.text
                async with asyncio.timeout(10):
                    got = await http.get("/v1/responses/resp_held")
    finally:
        hold.set()
    assert got.status_code == 504
    assert got.json()["error"]["code"] == "upstream_timeout"


async def test_a_streams_time_to_first_token_is_learned_at_its_first_token() -> None:
    """A Responses stream opens with events sent before the prefill (vLLM sends them when it
    accepts the request): the calibrator must learn the time to the first token, which the
    simulator holds for at least its 300 ms prefill overhead, not to those events."""
    sim = SimConfig(prefill_overhead_ms=300.0, itl_ms=1.0)
    async with start_replicas(1, sim) as reps, running_gateway(
        gateway_config([reps[0].url])
    ) as gw:
        learned = learned_first_tokens(gw.gateway.calibrator)
        body = {"model": MODEL, "input": "hello there", "max_output_tokens": 3, "stream": True}
        async with httpx.AsyncClient() as http:
            reply = await http.post(gw.url + "/v1/responses", json=body, timeout=30)
        assert reply.status_code == 200 and b"response.completed" in reply.content
    assert len(learned) == 1 and learned[0] >= 0.3, learned


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def test_a_stream_that_opens_and_never_starts_goes_to_another_endpoint() -> None:
    """vLLM sends a Responses stream's opening events when it accepts the request, before
    queueing and prefill: the first-byte timeout runs to the first token, and until then the
    request can still go elsewhere, with nothing sent to the client."""
    hang, served = asyncio.Event(), []

    async def create(request: Request) -> Response:
        await request.body()
        first = not served
        served.append(first)
        resp = {"id": f"resp_{len(served)}", "object": "response", "status": "in_progress"}

        async def body() -> AsyncIterator[bytes]:
            yield _sse("response.created", {"type": "response.created", "response": resp})
            yield _sse("response.in_progress", {"type": "response.in_progress", "response": resp})
            if first:
                await hang.wait()  # accepted, then stuck before its first token
            yield _sse("response.output_text.delta", {"type": "response.output_text.delta",
                                                      "delta": "hi"})
            done = {**resp, "status": "completed"}
            yield _sse("response.completed", {"type": "response.completed", "response": done})

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/responses", create, methods=["POST"]), *replica_routes()])
    try:
        async with serve_app(app) as a, serve_app(app) as b:
            config = gateway_config(
                [a, b], proxy={"firstByteTimeoutSeconds": 0.3, "idleTimeoutSeconds": 300},
            )
            async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
                async with asyncio.timeout(10):
                    got = await http.post(
                        "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
                    )
                retries = gw.gateway.metrics.registry.get_sample_value("prefixgate_retries_total")
    finally:
        hang.set()
    assert got.status_code == 200
    assert got.text.count("event: response.created") == 1 and "response.completed" in got.text
    assert "resp_2" in got.text and "resp_1" not in got.text
    assert retries == 1


async def test_a_client_gone_while_a_stored_response_is_awaited_cancels_it_upstream() -> None:
    """``GET /v1/responses/{id}`` (a background response's ``?stream=true`` too) is relayed
    by pass_through, which watched for the client only once the holder had answered: a client
    gone before that left the request upstream until its first byte (up to the first-byte
    timeout, a connection slot held), and then the whole answer was relayed to nobody."""
    stored = {"id": "resp_held", "object": "response", "status": "completed", "output": []}
    asked, dropped = asyncio.Event(), asyncio.Event()

    async def create(request: Request) -> Response:
        return Response(orjson.dumps(stored), media_type="application/json")

    async def retrieve(request: Request) -> Response:
        asked.set()
        # A holder that takes its time, until the gateway drops the request.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        dropped.set()
        return Response(b"")

    app = Starlette(routes=[
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        *replica_routes(),
    ])
    async with serve_app(app) as url:
        config = gateway_config([url], responses={"probeTimeoutSeconds": 0})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            made = await http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
            assert made.status_code == 200 and made.json()["id"] == "resp_held", made.text
            waiting = asyncio.create_task(http.get("/v1/responses/resp_held"))
            await asyncio.wait_for(asked.wait(), 10)
            waiting.cancel()  # the client leaves: httpx drops its connection
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            # Bounded far above the fast path: the gateway cancels at once on the disconnect.
            await asyncio.wait_for(dropped.wait(), 10)
