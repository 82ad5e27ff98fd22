"""Graceful shutdown of a real ``python -m router.cli serve`` process on SIGTERM.

Readiness turns false at once, new connections are refused after the shutdown delay, in-flight
streams drain, and the process exits 0; past the drain deadline a stream ends with an SSE error
event and a request still waiting gets a 503, instead of being cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from tests.gateways import MODEL
from tests.processes import gateway_process

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def shutdown_gateway(
    tmp_path: Path, replicas: list[Replica], server: dict[str, Any]
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, Path]]:
    config = {"server": server, "pool": {"endpoints": [{"url": r.url} for r in replicas]}}
    async with gateway_process(tmp_path, config) as gw:
        yield gw.proc, gw.url, gw.log_path


async def _exit_code(proc: asyncio.subprocess.Process, seconds: float) -> int | None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            return await proc.wait()
    return proc.returncode


async def _poll(probe: Callable[[], Any], until: Callable[[Any], bool], seconds: float) -> Any:
    result = None
    for _ in range(int(seconds / 0.02)):
        result = await probe()
        if until(result):
            return result
        await asyncio.sleep(0.02)
    return result


async def _ready_status(url: str) -> int | str:
    try:
        # A new connection each time: what a load balancer's probe does.
        async with httpx.AsyncClient(timeout=1) as http:
            return (await http.get(f"{url}/ready")).status_code
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        # Accepted by the kernel into the listener's backlog just as the listener closed, then
        # dropped unanswered: as refused for a probe (and the next connection is refused).
        return "refused"


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    content = f"shutdown test {max_tokens} {stream}"
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}


def _access_lines(log_path: Path) -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in log_path.read_bytes().splitlines() if line.strip()]
    return [line for line in lines if line["logger"] == "prefixgate.access"]


async def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path: Path) -> None:
    async with (
        start_replicas(2, SimConfig(speed=20.0)) as replicas,
        shutdown_gateway(
            tmp_path, replicas, {"shutdownDelaySeconds": 1.5, "drainTimeoutSeconds": 10}
        ) as (proc, url, log_path),
        httpx.AsyncClient(base_url=url, timeout=20) as http,
    ):
        # About 3 s of tokens at 20x speed: it outlives the shutdown delay.
        async with http.stream("POST", "/v1/chat/completions", json=_body(5000, True)) as resp:
            body = resp.aiter_bytes()
            chunks = [await anext(body)]
            proc.send_signal(signal.SIGTERM)
            status = await _poll(lambda: _ready_status(url), lambda s: s != 200, 1.2)
            assert status == 503, "readiness turns false at once"
            refused = await _poll(lambda: _ready_status(url), lambda s: s == "refused", 5)
            assert refused == "refused", "new connections are refused after the delay"
            assert proc.returncode is None, "still draining the stream"
            chunks += [chunk async for chunk in body]
        code = await _exit_code(proc, 10)
    text = b"".join(chunks)
    assert text.rstrip().endswith(b"data: [DONE]") and b'"error"' not in text
    assert code == 0
    access = _access_lines(log_path)
    assert [(a["status"], a["outcome"], a["stream"]) for a in access] == [(200, "ok", True)]
    assert access[0]["request_id"] and access[0]["endpoint"] and access[0]["ttfb_ms"] > 0


async def test_past_the_drain_deadline_requests_end_cleanly(tmp_path: Path) -> None:
    async with (
        start_replicas(2, SimConfig(speed=20.0)) as replicas,
        shutdown_gateway(
            tmp_path, replicas, {"shutdownDelaySeconds": 0, "drainTimeoutSeconds": 0.5}
        ) as (proc, url, _),
        httpx.AsyncClient(base_url=url, timeout=20) as http,
    ):
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=_body(50_000, False)))
        async with http.stream("POST", "/v1/chat/completions", json=_body(50_000, True)) as resp:
            body = resp.aiter_bytes()
            chunks = [await anext(body)]
            engines = [r.engine for r in replicas]
            running = await _poll(
                _async(lambda: sum(len(e.running) for e in engines)), lambda n: n == 2, 5
            )
            assert running == 2
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(5):
                chunks += [chunk async for chunk in body]
        async with asyncio.timeout(5):
            answer = await waiting
        code = await _exit_code(proc, 10)
        freed = await _poll(
            _async(lambda: sum(len(e.running) for e in engines)), lambda n: n == 0, 5
        )
    events = [e for e in b"".join(chunks).split(b"\n\n") if e.strip()]
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
    assert code == 0
    assert freed == 0, "the replicas' work was cancelled"


def _async(fn: Callable[[], Any]) -> Callable[[], Any]:
    async def probe() -> Any:
        return fn()

    return probe
