"""The simulator's agent APIs (Anthropic Messages, OpenAI Responses) over real loopback sockets,
driven by the official SDKs, plus forced tool calls on chat completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig

MODEL = "sim-model"
TOOLS_ANTHROPIC = [
    {
        "name": "search",
        "description": "search the code base",
        "input_schema": {"type": "object", "properties": {"input": {"type": "string"}}},
    }
]
TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the code base",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
        },
    }
]
TOOLS_RESPONSES = [{"type": "function", **TOOLS_CHAT[0]["function"]}]
SYSTEM = "you are a careful coding agent working in a large repository " * 6
USER = "please find where the retry budget is configured and explain it " * 4


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    async with start_replicas(1, SimConfig(speed=50)) as replicas:
        yield replicas[0]


@pytest.fixture
async def claude(replica: Replica) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=replica.url, api_key="k", max_retries=0) as c:
        yield c


@pytest.fixture
async def oai(replica: Replica) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=replica.url + "/v1", api_key="k", max_retries=0
    ) as client:
        yield client


def sse(text: str) -> list[tuple[str | None, Any]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: ") :])
        events.append((name, data))
    return events


# -- Messages ---------------------------------------------------------------------------------


async def test_messages_prompt_matches_chat_and_shares_its_cache(
    replica: Replica, claude: anthropic.AsyncAnthropic, oai: openai.AsyncOpenAI
) -> None:
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        max_tokens=5,
    )
    message = await claude.messages.create(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
        max_tokens=5,
    )
    assert chat.usage is not None
    usage = message.usage
    # Anthropic's meaning: input_tokens are the ones not read from the cache.
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    block = replica.sim.config.block_size
    assert usage.cache_read_input_tokens == (chat.usage.prompt_tokens - 1) // block * block
    # Same prompt tokens, so the same (deterministic) answer.
    assert message.content[0].type == "text"
    assert message.content[0].text == chat.choices[0].message.content
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens"


async def test_messages_stream_events_in_order(replica: Replica) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": USER}],
    }
    async with httpx.AsyncClient(base_url=replica.url) as http:
        full = (await http.post("/v1/messages", json={**body, "stream": False})).json()
        resp = await http.post("/v1/messages", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse(resp.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:-3] == ["content_block_delta"] * 6
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == full["content"][0]["text"]
    assert events[-2][1]["usage"]["output_tokens"] == 6


async def test_messages_forced_tool_use_streaming_and_not(
    claude: anthropic.AsyncAnthropic,
) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 7,
        "tools": TOOLS_ANTHROPIC,
        "tool_choice": {"type": "tool", "name": "search"},
        "messages": [{"role": "user", "content": USER}],
    }
    plain = await claude.messages.create(**ask)
    async with claude.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for message in (plain, streamed):
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "search"
        assert block.id.startswith("toolu_")
    assert plain.content[0].input == streamed.content[0].input  # type: ignore[union-attr]
    assert set(plain.content[0].input) == {"input"}  # type: ignore[union-attr]


async def test_tool_turns_render_like_chat(
    claude: anthropic.AsyncAnthropic, oai: openai.AsyncOpenAI
) -> None:
    """A tool_use / tool_result exchange costs the same prompt tokens as the chat equivalent."""
    claude_turn = await claude.messages.create(
        model=MODEL,
        max_tokens=3,
        system=SYSTEM,
        tools=TOOLS_ANTHROPIC,  # type: ignore[arg-type]
        messages=[
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "let me look"},
                    {"type": "tool_use", "id": "t1", "name": "search", "input": {"input": "retry"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "retry.py: budget = 3"},
                    {"type": "text", "text": "and the default?"},
                ],
            },
        ],
    )
    chat_turn = await oai.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        tools=TOOLS_CHAT,  # type: ignore[arg-type]
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": "let me look",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"input":"retry"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "retry.py: budget = 3"},
            {"role": "user", "content": "and the default?"},
        ],
    )
    assert chat_turn.usage is not None
    usage = claude_turn.usage
    assert (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat_turn.usage.prompt_tokens
    )
    details = chat_turn.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (usage.input_tokens - 1) // 16 * 16


async def test_messages_errors_in_anthropic_shape(
    replica: Replica, claude: anthropic.AsyncAnthropic
) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        await claude.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.create(
            model="other", messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=replica.url) as http:
        await http.post("/sim/faults", json={"fail_rate": 1.0, "status": 503})
        failed = await http.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
    assert failed.status_code == 503
    assert failed.json()["error"]["type"] == "overloaded_error"


# -- Responses --------------------------------------------------------------------------------


async def test_responses_follow_up_continues_the_stored_conversation(
    oai: openai.AsyncOpenAI,
) -> None:
    first = await oai.responses.create(
        model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=20
    )
    assert first.id.startswith("resp_") and first.status == "completed"
    follow = await oai.responses.create(
        model=MODEL, previous_response_id=first.id, input="and the default?", max_output_tokens=4
    )
    # The same conversation sent in full (without the instructions, which do not carry over
    # from one response to the next) is the prompt the follow-up ran on: same size, all cached.
    control = await oai.responses.create(
        model=MODEL,
        max_output_tokens=4,
        input=[
            {"role": "user", "content": USER},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and the default?"},
        ],
    )
    assert follow.usage is not None and control.usage is not None
    assert control.usage.input_tokens == follow.usage.input_tokens
    cached = control.usage.input_tokens_details.cached_tokens
    assert cached == (control.usage.input_tokens - 1) // 16 * 16
    assert follow.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        await oai.responses.create(model=MODEL, previous_response_id="resp_nope", input="x")


async def test_responses_stream_typed_events(replica: Replica, oai: openai.AsyncOpenAI) -> None:
    body = {"model": MODEL, "input": USER, "max_output_tokens": 5, "stream": True}
    async with httpx.AsyncClient(base_url=replica.url) as http:
        resp = await http.post("/v1/responses", json=body)
    events = sse(resp.text)
    names = [name for name, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, completed = events[0][1]["response"], events[-1][1]["response"]
    assert created["id"] == completed["id"]
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == completed["output"][0]["content"][0]["text"]
    stored = await oai.responses.retrieve(completed["id"])
    assert stored.output_text == deltas


async def test_responses_function_call_round_trip(oai: openai.AsyncOpenAI) -> None:
    async with oai.responses.stream(
        model=MODEL,
        input=USER,
        tools=TOOLS_RESPONSES,  # type: ignore[arg-type]
        tool_choice="required",
        max_output_tokens=6,
    ) as stream:
        first = await stream.get_final_response()
    (call,) = first.output
    assert call.type == "function_call" and call.name == "search"
    assert set(orjson.loads(call.arguments)) == {"input"}
    second = await oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        max_output_tokens=3,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "found it"}],
    )
    assert second.output_text


async def test_responses_store_get_delete(oai: openai.AsyncOpenAI) -> None:
    kept = await oai.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    unkept = await oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert (await oai.responses.retrieve(kept.id)).id == kept.id
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unkept.id)
    await oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(kept.id)


# -- chat completions with a forced tool -------------------------------------------------------


async def test_chat_forced_tool_call_streaming_and_not(oai: openai.AsyncOpenAI) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "tools": TOOLS_CHAT,
        "tool_choice": "required",
        "messages": [{"role": "user", "content": USER}],
    }
    plain = await oai.chat.completions.create(**ask)
    (call,) = plain.choices[0].message.tool_calls or []
    assert plain.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "search"  # type: ignore[union-attr]
    arguments = ""
    async for chunk in await oai.chat.completions.create(**ask, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            arguments += (delta.function.arguments or "") if delta.function else ""
    assert arguments == call.function.arguments  # type: ignore[union-attr]
    auto = await oai.chat.completions.create(**{**ask, "tool_choice": "auto"})
    assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls
