"""The Anthropic Messages API at the gateway: rendering, validation, error shape, and the
anthropic SDK end to end over simulated replicas (and the prefix-reuse acceptance test)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.sim import anthropic_api as sim_anthropic
from benchmarks.sim.tokenizer import Tokenizer
from router.app import build_gateway
from router.core.errors import BadRequestError, SaturatedError, UpstreamError
from router.core.hashing import block_hashes
from router.protocol.anthropic import error_response, stream_error_event, to_chat
from router.protocol.parsing import ParsedRequest, parse_request
from tests.gateways import MODEL, gateway_config

SYSTEM = "you are a coding agent in a large repository; be careful and precise. " * 8
TOOLS = [
    {
        "name": "search",
        "description": "search the code base",
        "input_schema": {"type": "object", "properties": {"input": {"type": "string"}}},
    }
]


def parsed(body: dict[str, Any], api: str = "messages") -> ParsedRequest:
    return parse_request(api, orjson.dumps(body))  # type: ignore[arg-type]


def messages_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": messages, **extra}


# -- rendering ----------------------------------------------------------------------------------


def test_messages_render_as_the_chat_request_vllm_runs() -> None:
    """System, tools, text, images, tool_use and tool_result hash like the chat equivalent."""
    image = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    anthropic_body = messages_body(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at this"},
                    {"type": "image", "source": image},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "searching"},
                    {"type": "tool_use", "id": "t1", "name": "search", "input": {"input": "x"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "found"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
        system=[{"type": "text", "text": SYSTEM}],
        tools=TOOLS,
    )
    chat_body = {
        "model": MODEL,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "search",
                    "description": "search the code base",
                    "parameters": TOOLS[0]["input_schema"],
                },
            }
        ],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at this"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": "searching",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"input":"x"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "found"},
            {"role": "user", "content": "and now?"},
        ],
    }
    assert parsed(anthropic_body).rendered == parsed(chat_body, "chat").rendered


def test_a_growing_session_hashes_to_a_growing_chain() -> None:
    """Claude Code's habits (a per-request billing header, a cache_control marker moved to the
    newest block every turn) must not break the chain: each turn extends the previous one."""
    history: list[dict[str, Any]] = []
    previous: list[int] = []
    end = 0
    for turn in range(6):
        history.append(
            {"role": "user", "content": [{"type": "text", "text": f"step {turn} " * 40}]}
        )
        sent = copy.deepcopy(history)
        sent[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        body = messages_body(
            sent,
            tools=[{**TOOLS[0], "cache_control": {"type": "ephemeral"}}],
            system=[
                {"type": "text", "text": f"x-anthropic-billing-header: cch={turn:05d};"},
                {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
            ],
        )
        request = parsed(body)
        hashes = block_hashes(request.rendered, 64, MODEL)
        assert hashes[: len(previous)] == previous
        assert len(hashes) > len(previous)
        previous = hashes
        # The previous turn's answer starts where that turn's prompt ended.
        start = None if request.answer_span is None else request.answer_span[0]
        assert start == (end if turn else None)
        end = len(request.rendered.encode())
        history.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm " * turn, "signature": "s"},
                    {"type": "text", "text": f"answer {turn} " * 20},
                ],
            }
        )


def test_tool_use_arguments_keep_the_clients_key_order() -> None:
    """vLLM writes a tool_use block's input as the call's arguments with ``json.dumps(input)``,
    in the client's key order, and parses them back into a dict for the chat template, which
    renders them in that order (Qwen3-Coder's iterates ``arguments|items``); a replica's
    /tokenize parses the arguments precise routing sends it alike. Sorted, they tokenize apart
    from the engine's prompt from the first Edit or TodoWrite call on, and so do the block keys
    precise routing looks up."""
    edit = {"file_path": "a.py", "old_string": "x = 1", "new_string": "x = 2"}
    todos = {"todos": [{"content": "fix", "status": "pending", "activeForm": "fixing"}]}
    body = messages_body(
        [
            {"role": "user", "content": "fix it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "TodoWrite", "input": todos},
                    {"type": "tool_use", "id": "t2", "name": "Edit", "input": edit},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "ok"},
                ],
            },
        ]
    )
    messages, _ = to_chat(body)
    calls = messages[1]["tool_calls"]
    sent = [orjson.dumps(orjson.loads(c["function"]["arguments"])) for c in calls]
    assert sent == [orjson.dumps(todos), orjson.dumps(edit)]


def test_thinking_reaches_the_chat_request_as_the_assistants_reasoning() -> None:
    """vLLM carries an assistant's thinking blocks into the chat request as its ``reasoning``
    (reasoning models' templates render it in a tool loop, the turns after the last user
    query), so the chat request precise routing tokenizes must carry it too, or it tokenizes
    apart from the engine's prompt at the first such answer. The rendering the approximate
    index hashes still leaves thinking out."""
    call = {"type": "tool_use", "id": "t1", "name": "search", "input": {"input": "x"}}
    thinking = [
        {"type": "thinking", "thinking": "first look ", "signature": "s1"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": "for x", "signature": "s2"},
    ]
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    history = [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": [*thinking, call]},
        {"role": "user", "content": [result]},
    ]
    messages, _ = to_chat(messages_body(history))
    assert messages[1]["reasoning"] == "first look for x"
    assert messages[1]["tool_calls"][0]["id"] == "t1" and "content" not in messages[1]
    without = copy.deepcopy(history)
    without[1]["content"] = [call]
    assert "reasoning" not in to_chat(messages_body(without))[0][1]
    assert parsed(messages_body(history)).rendered == parsed(messages_body(without)).rendered


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (messages_body([]), "messages"),
        (messages_body([{"role": "robot", "content": "x"}]), "messages[0]"),
        (messages_body([{"role": "user", "content": 5}]), "messages[0].content"),
        (messages_body([{"role": "user", "content": [{"text": "x"}]}]), "messages[0].content[0]"),
        (messages_body([{"role": "user", "content": "x"}], system=7), "system"),
        (messages_body([{"role": "user", "content": "x"}], tools=[{"x": 1}]), "tools"),
        (messages_body([{"role": "user", "content": "x"}], tool_choice="any"), "tool_choice"),
        (messages_body([{"role": "user", "content": "x"}], metadata={"user_id": 3}), "metadata"),
    ],
)
def test_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parsed(body)
    assert info.value.param == param


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=15,
)
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "x"])},
    optional={
        "text": json_values,
        "content": json_values,
        "input": json_values,
        "source": json_values,
        "id": json_values,
        "tool_use_id": json_values,
    },
)
message_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 3)},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", "ctx"]) | json_values,
                    "content": st.text(max_size=5) | st.lists(blocks, max_size=3) | json_values,
                }
            ),
            max_size=3,
        )
        | json_values,
        "system": st.text(max_size=5) | st.lists(blocks, max_size=2) | json_values,
        "tools": st.lists(
            st.dictionaries(st.sampled_from(["name", "input_schema"]), json_values), max_size=2
        )
        | json_values,
        "tool_choice": json_values,
        "metadata": json_values,
    },
)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(message_bodies)
def test_any_body_parses_or_is_a_400(body: dict[str, Any]) -> None:
    try:
        result = parsed(body)
    except BadRequestError:
        return
    assert result.api == "messages" and isinstance(result.rendered, str)


# -- error shape and session key ------------------------------------------------------------------


def test_errors_take_anthropics_shape_and_shedding_is_529() -> None:
    shed = error_response(SaturatedError("queues are full", retry_after=2.0))
    assert shed.status_code == 529 and shed.headers["retry-after"] == "2"
    assert orjson.loads(shed.body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "queues are full"},
    }
    bad = orjson.loads(error_response(BadRequestError("nope", param="x")).body)
    assert bad["error"]["type"] == "invalid_request_error"
    assert orjson.loads(error_response(UpstreamError("down")).body)["error"]["type"] == "api_error"
    event = stream_error_event("cut", "service_unavailable", 503)
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    data = orjson.loads(event.split(b"data: ", 1)[1])
    assert data["type"] == "error"
    # The gateway shutting down mid-stream: try again later, as Anthropic says it.
    assert data["error"]["type"] == "overloaded_error"


def test_metadata_user_id_is_the_session_unless_a_header_says_otherwise() -> None:
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    router = build_gateway(gateway_config([], pool={"endpoints": [endpoint]})).router
    body = messages_body([{"role": "user", "content": "x"}], metadata={"user_id": "u_session_7"})
    assert router.routing_request(parsed(body), {}, "r").session_id == "u_session_7"
    header = router.routing_request(parsed(body), {"x-session-id": "s"}, "r")
    assert header.session_id == "s"


def test_precise_routing_tokenizes_the_chat_request_vllm_runs() -> None:
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    config = gateway_config([], pool={"endpoints": [endpoint]}, strategy="precise")
    gateway = build_gateway(config)
    body = messages_body(
        [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        system=SYSTEM,
        tools=TOOLS,
    )
    routing = gateway.router.routing_request(parsed(body), {}, "r1")
    assert gateway.precise is not None
    state = gateway.precise.tracker.state(routing.serial)
    assert state is not None and state.source.api == "chat"
    tokenizer = Tokenizer()
    chat = sim_anthropic.to_chat_body(body)
    source = state.source.payload
    assert tokenizer.encode_chat(source["messages"], source["tools"]) == tokenizer.encode_chat(
        chat["messages"], chat["tools"]
    )
