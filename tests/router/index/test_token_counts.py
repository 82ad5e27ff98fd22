"""Token counts asked of a replica's /tokenize for prompts whose answers will report none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import EndpointSnapshot, endpoint_id_from_url
from router.estimators.token_density import TokenDensity
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.sizing import IndexSizer
from router.index.token_counts import (
    ATTEMPTS_PER_SAMPLE,
    UNABLE_RETRY_S,
    TokenCounts,
    reports_usage,
    tokenize_body,
)
from router.upstream.client import UpstreamClient
from tests.manual_clock import ManualClock

MODEL = "sim-model"
MESSAGES = [{"role": "user", "content": "alpha beta gamma delta " * 40}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "stream": True, **extra}


def _snapshot(url: str) -> EndpointSnapshot:
    return EndpointSnapshot(
        id=endpoint_id_from_url(url), url=url, role="both", in_flight=0,
        pending_prefill_tokens=0, waiting=0, running=0, kv_usage=0, metrics_age=0,
    )


def _counts(samples: int = 16) -> tuple[TokenCounts, IndexSizer, UpstreamClient]:
    sizer = IndexSizer(InMemoryPrefixIndex(), TokenDensity(min_samples=1), 256)
    client = UpstreamClient(4, 2.0)
    return TokenCounts(sizer, client, samples=samples), sizer, client


def test_which_answers_report_usage() -> None:
    assert reports_usage("chat", False, {})
    assert not reports_usage("chat", True, {})
    assert not reports_usage("completions", True, {"stream_options": {"include_usage": False}})
    assert reports_usage("chat", True, {"stream_options": {"include_usage": True}})
    # Messages streams carry it in message_start, Responses streams in response.completed.
    assert reports_usage("messages", True, {}) and reports_usage("responses", True, {})


def test_the_tokenize_body_asks_for_what_the_completion_would_count() -> None:
    chat = tokenize_body("chat", MODEL, _chat(tools=TOOLS))
    assert chat == {
        "model": MODEL, "messages": MESSAGES, "add_generation_prompt": True, "tools": TOOLS,
    }
    # What else changes the prompt's tokens goes along (Qwen3's thinking switch, say).
    kwargs = {"enable_thinking": False}
    thinking = tokenize_body("chat", MODEL, _chat(chat_template_kwargs=kwargs))
    assert thinking is not None and thinking["chat_template_kwargs"] == kwargs
    assert tokenize_body("completions", MODEL, {"prompt": "once"}) == {
        "model": MODEL, "prompt": "once",
    }
    assert tokenize_body("completions", MODEL, {"prompt": ["a", "b"]}) is None  # a batch
    assert tokenize_body("completions", MODEL, {"prompt": [1, 2]}) is None  # already ids
    assert tokenize_body("chat", MODEL, {"messages": []}) is None
    assert tokenize_body("messages", MODEL, {"messages": MESSAGES}) is None


async def test_a_stream_without_usage_is_counted_by_the_replica() -> None:
    async with start_replicas(1, SimConfig(zero_latency=True, bytes_per_token=9.0)) as reps:
        url = reps[0].url
        async with httpx.AsyncClient() as http:
            body = tokenize_body("chat", MODEL, _chat())
            expected = (await http.post(url + "/tokenize", json=body)).json()["count"]
        counts, sizer, client = _counts(samples=2)
        try:
            endpoint, size = _snapshot(url), 9 * expected + 5  # the gateway's rendered bytes
            counts.consider("chat", True, _chat(), MODEL, size, endpoint)
            assert not counts.wants(MODEL)  # one call at a time per model
            await counts.settle()
            assert sizer.density.ratio(MODEL) == size / expected
            # Answers that report usage teach the ratio themselves: nothing is asked.
            for api, stream, payload in (
                ("chat", False, _chat(stream=False)),
                ("chat", True, _chat(stream_options={"include_usage": True})),
                ("messages", True, _chat()),
            ):
                counts.consider(api, stream, payload, MODEL, size, endpoint)
                assert counts.wants(MODEL)
            counts.consider("chat", True, _chat(), MODEL, size, endpoint)
            await counts.settle()
            assert sizer.density.samples(MODEL) == 2
            assert not counts.wants(MODEL)  # enough samples: no more calls
        finally:
            await counts.aclose()
            await client.aclose()


@asynccontextmanager
async def _answering(status: int, body: bytes = b"") -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback server answering every request with ``status`` and ``body``, and the
    request lines it got."""
    seen: list[bytes] = []
    reason = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable"}[status]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b"\r\n", 1)[0])
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length:")),
            0,
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


async def _ask_three_times(counts: TokenCounts, url: str) -> None:
    for _ in range(3):
        counts.consider("chat", True, _chat(), MODEL, 5000, _snapshot(url))
        await counts.settle()


async def test_an_endpoint_without_tokenize_is_not_asked_again_for_a_while() -> None:
    clock = ManualClock()
    async with _answering(404) as (url, seen):
        sizer = IndexSizer(InMemoryPrefixIndex(), TokenDensity(min_samples=1), 256)
        client = UpstreamClient(4, 2.0)
        counts = TokenCounts(sizer, client, clock=clock)
        try:
            await _ask_three_times(counts, url)
            assert seen == [b"POST /tokenize HTTP/1.1"]
            assert sizer.density.samples(MODEL) == 0
            assert counts.wants(MODEL)  # another endpoint may still be asked
            clock.now += UNABLE_RETRY_S  # a replaced pod at the same address may serve it
            await _ask_three_times(counts, url)
            assert len(seen) == 2
        finally:
            await counts.aclose()
            await client.aclose()


async def test_a_failing_endpoint_is_asked_again() -> None:
    async with _answering(503) as (url, seen):
        counts, sizer, client = _counts()
        try:
            await _ask_three_times(counts, url)
            assert len(seen) == 3 and sizer.density.samples(MODEL) == 0
        finally:
            await counts.aclose()
            await client.aclose()


async def test_counts_the_ratio_rejects_use_up_a_bounded_budget() -> None:
    """A prompt that is mostly template counts as an absurd ratio, which is no sample: the
    calls stop all the same."""
    async with _answering(200, b'{"count": 1}') as (url, seen):
        counts, sizer, client = _counts(samples=2)
        try:
            for _ in range(4 * ATTEMPTS_PER_SAMPLE):
                counts.consider("chat", True, _chat(), MODEL, 5000, _snapshot(url))
                await counts.settle()
            assert len(seen) == 2 * ATTEMPTS_PER_SAMPLE
            assert sizer.density.samples(MODEL) == 0 and not counts.wants(MODEL)
        finally:
            await counts.aclose()
            await client.aclose()
