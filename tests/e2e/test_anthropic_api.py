"""The Anthropic Messages API end to end: the anthropic SDK through the gateway to simulated
replicas, errors in Anthropic's shape, and the prefix-reuse acceptance test."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
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
from tests.e2e.test_reliability_support import serve_app
from tests.gateways import MODEL, gateway_config
from tests.router.protocol.test_anthropic import SYSTEM, TOOLS, messages_body

# -- end to end through the anthropic SDK ---------------------------------------------------------


@pytest.fixture
async def claude(gateway: RunningGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="k", max_retries=0) as c:
        yield c


async def test_agent_session_streaming_and_not_with_tool_turns(
    claude: anthropic.AsyncAnthropic,
) -> None:
    """A session alternating forced tool calls (streamed) and text answers stays on one replica
    and reads a growing share of its prompt from that replica's cache."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "find the retry budget " * 30}]
    homes, cached = set(), []
    for turn in range(6):
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 12,
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": history,
        }
        if turn % 2 == 0:
            raw = await claude.messages.with_raw_response.create(
                **ask, tool_choice={"type": "any"}, metadata={"user_id": "session-a"}
            )
            reply = await raw.parse()
        else:
            async with claude.messages.stream(**ask, metadata={"user_id": "session-a"}) as stream:
                reply = await stream.get_final_message()
            raw = stream.response  # type: ignore[assignment]
        homes.add(raw.headers["x-gateway-destination-endpoint"])
        cached.append(reply.usage.cache_read_input_tokens or 0)
        history.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        if reply.stop_reason == "tool_use":
            use = reply.content[0]
            assert use.type == "tool_use"
            history.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "budget.py " * 20}
                    ],
                }
            )
        else:
            history.append({"role": "user", "content": "and the default? " * 10})
    assert len(homes) == 1
    assert cached[0] == 0 and all(a < b for a, b in itertools.pairwise(cached))


async def test_token_counts_are_passed_to_an_endpoint_outside_flow_control(
    claude: anthropic.AsyncAnthropic, gateway: RunningGateway
) -> None:
    """Claude Code counts a prompt's tokens to size its context: a replica tokenizes it,
    and the gateway neither queues nor indexes it."""
    ask: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "tools": TOOLS}
    short = await claude.messages.count_tokens(
        **ask, messages=[{"role": "user", "content": "hi"}]
    )
    long = await claude.messages.count_tokens(
        **ask, messages=[{"role": "user", "content": "a longer question " * 50}]
    )
    assert 0 < short.input_tokens < long.input_tokens
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.count_tokens(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert gateway.gateway.flow.outstanding(MODEL) == 0
    assert sum(s.in_flight for s in gateway.gateway.pool) == 0


async def test_bad_input_gets_anthropic_errors_from_the_gateway(
    claude: anthropic.AsyncAnthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        await claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "robot", "content": "x"}],  # type: ignore[typeddict-item]
        )
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0] must be an object whose role is 'user' or 'assistant'",
        },
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.create(
            model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


async def test_shed_requests_get_529_overloaded() -> None:
    flow = {"saturationDetector": {"inFlightThreshold": 1}, "defaultRequestTTL": 0.05}
    async with (
        start_replicas(1, SimConfig(speed=1.0)) as replicas,
        running_gateway(gateway_config([r.url for r in replicas], flowControl=flow)) as gw,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as claude,
    ):
        ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with claude.messages.stream(**ask, max_tokens=200) as busy:
            await busy.__anext__()  # the replica's one slot is taken until the stream ends
            with pytest.raises(anthropic.APIStatusError) as shed:
                await claude.messages.create(**ask, max_tokens=2)
    assert shed.value.status_code == 529
    assert shed.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


class StallingUpstream:
    """Records the headers of each Messages request; streams one event, then stalls."""

    def __init__(self) -> None:
        self.received: list[dict[str, str]] = []

    def app(self) -> Starlette:
        async def messages(request: Request) -> Response:
            self.received.append(dict(request.headers))
            await request.body()
            return StreamingResponse(self._stall(), media_type="text/event-stream")

        async def ok(request: Request) -> Response:
            body = b'{"data": [{"id": "sim-model"}]}' if request.url.path == "/v1/models" else b""
            return Response(body, media_type="application/json")

        routes = [Route("/v1/messages", messages, methods=["POST"])]
        routes += [Route(p, ok) for p in ("/health", "/metrics", "/v1/models")]
        return Starlette(routes=routes)

    async def _stall(self) -> AsyncIterator[bytes]:
        start = {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 0},
            },
        }
        yield b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"
        await asyncio.sleep(30)


async def test_headers_forwarded_and_mid_stream_errors_are_anthropic_events() -> None:
    upstream = StallingUpstream()
    async with (
        serve_app(upstream.app()) as url,
        running_gateway(gateway_config([url], proxy={"idleTimeoutSeconds": 0.3})) as gw,
    ):
        async with (
            anthropic.AsyncAnthropic(
                base_url=gw.url,
                api_key="client-key",
                max_retries=0,
                default_headers={"anthropic-beta": "tools-2024"},
            ) as claude,
            claude.messages.stream(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
            ) as stream,
        ):
            with pytest.raises(anthropic.APIStatusError) as failed:
                await stream.get_final_message()
        async with httpx.AsyncClient(base_url=gw.url) as http:
            raw = await http.post(
                "/v1/messages",
                json=messages_body([{"role": "user", "content": "x"}], stream=True),
                headers={"x-api-key": "client-key", "anthropic-version": "2023-06-01"},
            )
    assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "idle timeout" in failed.value.body["error"]["message"]  # type: ignore[index]
    assert raw.text.endswith("\n\n") and "\n\nevent: error\ndata: " in raw.text
    by_sdk, by_hand = upstream.received
    assert by_sdk["anthropic-beta"] == "tools-2024" and by_sdk["anthropic-version"]
    assert by_hand["x-api-key"] == "client-key" and by_hand["anthropic-version"] == "2023-06-01"


async def test_x_api_key_authenticates_and_401_is_anthropic_shaped(
    replicas: list[Replica],
) -> None:
    auth = {"enabled": True, "apiKeys": [{"key": "secret-a", "tenant": "a"}]}
    async with running_gateway(gateway_config([r.url for r in replicas], auth=auth)) as gw:
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
        }
        async with anthropic.AsyncAnthropic(
            base_url=gw.url, api_key="secret-a", max_retries=0
        ) as good:
            assert (await good.messages.create(**ask)).content
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await bad.messages.create(**ask)
        async with httpx.AsyncClient(base_url=gw.url) as http:
            by_header = await http.post("/v1/messages", json=ask, headers={"x-api-key": "secret-a"})
    assert by_header.status_code == 200
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


# -- acceptance -----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_messages_capture_as_much_prefix_reuse_as_chat() -> None:
    """The same agentic sessions (tool calls, tool results, Claude Code's moving cache markers
    and billing header; no session key, so only the prefix index keeps them together) over 4
    replicas: the anthropic SDK's sessions capture the reuse chat completions' sessions do."""
    sessions = agentic_sessions(sessions=24, turns=8)
    chat, chat_outcome, chat_reuse = await captured_share("chat", sessions)
    messages, outcome, reuse = await captured_share("messages", sessions)
    print(f"captured share: chat {chat:.3f}, messages {messages:.3f}")
    assert chat_outcome.errors == outcome.errors == 0
    # Both APIs render to the same prompts on the replicas: the same reuse is on offer.
    assert reuse.reusable_tokens == chat_reuse.reusable_tokens
    # Runs of either API vary by about +-2 points (placement under concurrent load).
    assert messages >= chat - 0.04
    assert messages >= 0.9  # round-robin captures ~0.65 of this workload
