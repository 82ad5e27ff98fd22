"""The OpenAI Responses API at the gateway: rendering, validation, the response-id memory
(local and through Redis), and the openai SDK end to end over simulated replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from benchmarks.agent_reuse import agentic_sessions, captured_share
from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.app import build_gateway
from router.core.endpoints import Endpoint, EndpointPool, EndpointSnapshot
from router.core.errors import BadRequestError, ResponseNotFoundError, ResponseUnavailableError
from router.core.hashing import block_hashes
from router.index.response_store import ResponseIdTap, ResponseRoutes
from router.protocol.parsing import ParsedRequest, parse_request
from router.serve.server import RunningGateway, running_gateway
from tests.e2e.test_reliability_support import serve_app
from tests.gateways import MODEL, gateway_config

DESTINATION = "x-gateway-destination-endpoint"
TOOL = {
    "type": "function",
    "name": "search",
    "description": "search the code",
    "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
}


def parsed(body: dict[str, Any], api: str = "responses") -> ParsedRequest:
    return parse_request(api, orjson.dumps(body))  # type: ignore[arg-type]


# -- rendering and validation ---------------------------------------------------------------------


def test_responses_render_as_the_chat_request_vllm_runs() -> None:
    body = {
        "model": MODEL,
        "instructions": "be terse",
        "tools": [TOOL],
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": "https://x/y.png"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "content": [{"type": "output_text", "text": "checking", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "search",
                "arguments": '{"input":"y"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "a picture"},
            {"role": "user", "content": "thanks"},
        ],
    }
    chat = {
        "model": MODEL,
        "tools": [
            {
                "type": "function",
                "function": {k: TOOL[k] for k in ("name", "description", "parameters")},
            }
        ],
        "messages": [
            {"role": "system", "content": "be terse"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": "checking",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"input":"y"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a picture"},
            {"role": "user", "content": "thanks"},
        ],
    }
    assert parsed(body).rendered == parsed(chat, "chat").rendered


def test_full_history_resent_each_turn_hashes_to_a_growing_chain() -> None:
    items: list[dict[str, Any]] = []
    previous: list[int] = []
    end = 0
    for turn in range(5):
        items.append({"role": "user", "content": f"turn {turn} " * 30})
        body = {"model": MODEL, "instructions": "agent " * 50, "input": items, "store": False}
        request = parsed(body)
        hashes = block_hashes(request.rendered, 64, MODEL)
        assert hashes[: len(previous)] == previous and len(hashes) > len(previous)
        previous = hashes
        # The previous turn's answer (its function call) starts where its prompt ended.
        start = None if request.answer_span is None else request.answer_span[0]
        assert start == (end if turn else None)
        end = len(request.rendered.encode())
        items.append(
            {"type": "function_call", "call_id": f"c{turn}", "name": "search", "arguments": "{}"}
        )
        items.append({"type": "function_call_output", "call_id": f"c{turn}", "output": "ok"})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": "x", "previous_response_id": "../../admin"}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "tools": [3]}, "tools"),
    ],
)
def test_bad_bodies_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parsed({"model": MODEL, **extra})
    assert info.value.param == param


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=15,
)
items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "web_search_call"]
        )
        | json_values,
        "role": json_values,
        "content": json_values,
        "output": json_values,
        "call_id": json_values,
        "arguments": json_values,
    },
)
response_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={
        "input": st.text(max_size=5) | st.lists(items, max_size=3) | json_values,
        "instructions": json_values,
        "tools": st.lists(
            st.dictionaries(st.sampled_from(["type", "name"]), json_values), max_size=2
        )
        | json_values,
        "previous_response_id": json_values,
        "max_output_tokens": json_values,
        "prompt_cache_key": json_values,
    },
)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(response_bodies)
def test_any_body_parses_or_is_a_400(body: dict[str, Any]) -> None:
    try:
        result = parsed(body)
    except BadRequestError:
        return
    assert result.api == "responses" and isinstance(result.rendered, str)


def test_prompt_cache_key_is_the_session_and_previous_response_id_is_carried() -> None:
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    router = build_gateway(gateway_config([], pool={"endpoints": [endpoint]})).router
    body = {
        "model": MODEL,
        "input": "x",
        "prompt_cache_key": "conv-1",
        "previous_response_id": "resp_1",
    }
    routing = router.routing_request(parsed(body), {}, "r")
    assert routing.session_id == "conv-1" and routing.previous_response_id == "resp_1"


# -- the id tap and the id -> endpoint memory -----------------------------------------------------


def test_tap_finds_the_id_across_chunks_and_gives_up_after_its_limit() -> None:
    seen: list[str] = []
    tap = ResponseIdTap(seen.append)
    event = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_'
    tap(event)
    tap(b'abc123","object":"response"}}\n\n')
    tap(b'data: {"id":"resp_other"}\n\n')
    assert seen == ["resp_abc123"]
    lost: list[str] = []
    late = ResponseIdTap(lost.append, limit=32)
    late(b"x" * 40 + b'{"id":"resp_1"}')
    assert lost == [] and late.done


def pool_of(*urls: str) -> EndpointPool:
    pool = EndpointPool(Endpoint.from_url(u, models=[MODEL]) for u in urls)
    for state in pool:
        state.healthy = True
    return pool


async def test_routes_remember_expire_and_resolve_with_clear_errors() -> None:
    now = [0.0]
    routes = ResponseRoutes(ttl_seconds=10, max_entries=2, clock=lambda: now[0])
    pool = pool_of("http://a:1", "http://b:1")
    candidates = pool.candidates(MODEL)
    routes.remember("resp_1", "a:1")
    assert await routes.resolve("resp_1", pool, candidates) == "a:1"
    routes.remember("resp_2", "b:1")
    routes.remember("resp_3", "b:1")  # over max_entries: the oldest goes
    assert routes.local("resp_1") is None and len(routes) == 2
    now[0] = 11.0
    assert routes.local("resp_2") is None  # expired
    routes.remember("resp_4", "b:1")
    pool.get("b:1").healthy = False  # type: ignore[union-attr]
    with pytest.raises(ResponseUnavailableError) as down:
        await routes.resolve("resp_4", pool, pool.candidates(MODEL), "previous_response_id")
    assert down.value.status_code == 409 and down.value.param == "previous_response_id"
    pool.remove("b:1")
    with pytest.raises(ResponseNotFoundError) as gone:
        await routes.resolve("resp_4", pool, pool.candidates(MODEL))
    assert gone.value.code == "response_endpoint_gone"
    with pytest.raises(ResponseNotFoundError):
        await routes.resolve("resp_unknown", pool, pool.candidates(MODEL))


async def test_unknown_ids_are_looked_for_on_the_endpoints() -> None:
    pool = pool_of("http://a:1", "http://b:1", "http://c:1")
    asked: list[str] = []

    async def probe(endpoint: EndpointSnapshot, response_id: str) -> bool:
        asked.append(endpoint.id)
        if endpoint.id == "a:1":
            await asyncio.sleep(10)  # a slow endpoint does not hold the answer back
        return endpoint.id == "c:1"

    routes = ResponseRoutes(probe_timeout_seconds=1.0, probe=probe)
    async with asyncio.timeout(2):
        assert await routes.resolve("resp_9", pool, pool.candidates(MODEL)) == "c:1"
    assert sorted(asked) == ["a:1", "b:1", "c:1"]
    assert routes.local("resp_9") == "c:1"  # remembered: no second probe


@pytest.mark.redis
async def test_routes_are_shared_through_redis_with_expiry(
    redis_url: str, redis_namespace: str
) -> None:
    # A ttl a loaded machine's stall between writing and reading cannot outlast (0.3 s could).
    one = ResponseRoutes(ttl_seconds=1.0, url=redis_url, namespace=redis_namespace)
    two = ResponseRoutes(ttl_seconds=1.0, url=redis_url, namespace=redis_namespace)
    try:
        one.remember("resp_shared", "a:1")
        await one.flush()
        assert await two.endpoint_of("resp_shared") == "a:1"
        one.remember("resp_short", "b:1")
        await one.flush()
        await asyncio.sleep(1.2)
        assert await two.endpoint_of("resp_short") is None
        one.forget("resp_shared")
        await one.flush()
        three = ResponseRoutes(url=redis_url, namespace=redis_namespace)
        assert await three.endpoint_of("resp_shared") is None
        await three.aclose()
    finally:
        await one.aclose()
        await two.aclose()


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
