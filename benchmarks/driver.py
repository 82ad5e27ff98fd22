"""Drives a multi-session chat workload against any OpenAI-compatible endpoint.

A load generator, not the gateway: it uses aiohttp (the benchmark runner's client too), so that
``prefixgate demo`` needs nothing the gateway does not install.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.reuse import ReuseTracker
from benchmarks.sim.tokenizer import Tokenizer
from benchmarks.workloads import ChatSession, MultiSessionWorkload
from router.pool.engine_pages import parse_vllm_metrics


@dataclass(slots=True)
class DriveResult:
    requests: int = 0
    errors: int = 0
    destinations: dict[str, int] = field(default_factory=dict)
    reuse: ReuseTracker = field(default_factory=ReuseTracker)


async def _session(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    session: ChatSession,
    tokenizer: Tokenizer,
    result: DriveResult,
    on_request: Callable[[], None] | None,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": session.system}]
    for text in session.user_turns:
        messages.append({"role": "user", "content": text})
        prompt_ids = tokenizer.encode_chat(messages)
        body = {"model": model, "messages": messages, "max_tokens": session.max_tokens}
        headers = {"x-session-id": session.session_id, "content-type": "application/json"}
        async with client.post(
            f"{url}/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as resp:
            status, raw = resp.status, await resp.read()
            dest = resp.headers.get("x-gateway-destination-endpoint", "direct")
        result.requests += 1
        if on_request is not None:
            on_request()
        if status != 200:
            result.errors += 1
            return
        answer = orjson.loads(raw)["choices"][0]["message"]["content"]
        result.destinations[dest] = result.destinations.get(dest, 0) + 1
        result.reuse.observe(prompt_ids, tokenizer.encode(answer))
        messages.append({"role": "assistant", "content": answer})
        if session.think_seconds:
            await asyncio.sleep(session.think_seconds)


async def drive(
    url: str,
    workload: MultiSessionWorkload,
    model: str = "sim-model",
    deadline: float = 120.0,
    on_request: Callable[[], None] | None = None,
) -> DriveResult:
    """Run every session (turns in order within a session), at most ``concurrency`` at once."""
    result = DriveResult()
    tokenizer = Tokenizer()
    gate = asyncio.Semaphore(workload.concurrency)
    connector = aiohttp.TCPConnector(limit=workload.concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=deadline)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:

        async def one(session: ChatSession) -> None:
            async with gate:
                await _session(client, url, model, session, tokenizer, result, on_request)

        async with asyncio.timeout(deadline):
            await asyncio.gather(*(one(s) for s in workload.sessions))
    return result


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: float
    queries: float

    @property
    def ratio(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


async def cache_stats(urls: list[str]) -> dict[str, CacheStats]:
    """Each replica's prefix-cache counters (tokens), from its /metrics."""
    out: dict[str, CacheStats] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        for url in urls:
            async with client.get(f"{url}/metrics") as resp:
                resp.raise_for_status()
                m = parse_vllm_metrics(await resp.text(), 0.0)
            out[url] = CacheStats(m.prefix_hits, m.prefix_queries)
    return out


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        for url in urls:
            async with client.post(f"{url}/reset_prefix_cache") as resp:
                resp.raise_for_status()
