"""The OpenAI Responses API at the gateway: rendering, validation, the response-id memory
(local and through Redis), and the openai SDK end to end over simulated replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import build_gateway
from router.core.endpoints import Endpoint, EndpointSnapshot
from router.core.errors import BadRequestError, ResponseNotFoundError, ResponseUnavailableError
from router.core.hashing import block_hashes
from router.core.pool import EndpointPool
from router.index.response_store import ResponseIdTap, ResponseRoutes
from router.protocol.parsing import ParsedRequest, parse_request
from router.protocol.responses_api import FAILED, OPENING, TOKEN, answer_begun, to_chat
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


def test_reasoning_reaches_the_chat_request_as_the_assistants_reasoning() -> None:
    """vLLM makes a reasoning item the assistant's ``reasoning`` (its content's text, else its
    summary's), which reasoning models' templates render in a tool loop: the chat request
    precise routing tokenizes must carry it too. The rendering still leaves it out."""
    summary = [{"type": "summary_text", "text": "look it up"}]
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "find x"},
        {"type": "reasoning", "id": "rs_1", "summary": summary},
        {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {
            "type": "reasoning",
            "id": "rs_2",
            "summary": summary,
            "content": [{"type": "reasoning_text", "text": "x is found"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "found"}]},
        {"role": "user", "content": "thanks"},
    ]
    body = {"model": MODEL, "input": items}
    messages, _ = to_chat(body)
    assert [m.get("reasoning") for m in messages] == [None, "look it up", None, "x is found", None]
    assert messages[3]["content"] == [{"type": "text", "text": "found"}]
    bare = [{k: v for k, v in i.items() if k not in ("summary", "content")}
            if i.get("type") == "reasoning" else i for i in items]
    assert parsed(body).rendered == parsed({**body, "input": bare}).rendered


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


def _events(*names: str) -> bytes:
    return b"".join(
        b"event: %s\ndata: {\"type\": \"%s\"}\n\n" % (n.encode(), n.encode()) for n in names
    )


def test_a_responses_stream_has_begun_answering_past_its_opening_events() -> None:
    opening = _events(
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    )
    assert answer_begun(opening) == OPENING
    assert answer_begun(opening + _events("response.output_text.delta")) == TOKEN
    assert answer_begun(_events("response.function_call_arguments.delta")) == TOKEN
    assert answer_begun(_events("response.completed")) == TOKEN
    assert answer_begun(opening + _events("error")) == FAILED
    assert answer_begun(_events("response.failed")) == FAILED
    # CRLF line endings, and a chunk that ends inside an event line (the next chunk has it).
    assert answer_begun(opening.replace(b"\n", b"\r\n")) == OPENING
    assert answer_begun(opening + b"event: response.output_te") == OPENING
    # A server that sends no event lines: the events' types, roughly.
    created = b'data: {"type":"response.created","response":{"error":null}}\n\n'
    assert answer_begun(created) == OPENING
    assert answer_begun(b'data: {"type":"response.output_text.delta","delta":"x"}\n\n') == TOKEN
    assert answer_begun(b'data: {"type":"error","message":"no"}\n\n') == FAILED
