"""Which HTTP client the gateway's own calls (scrapes, health checks, tokenizer, API server) cost
the least: CPU per call on the calling process's event loop, and latency.

Starts one simulated replica in its own process (uvicorn with uvloop and httptools, as vLLM
serves) with one more route, ``/metrics-vllm``: the replica's own metrics page padded with
histogram families to ``--page-kb`` (a vLLM page with its histograms is tens of KB, the
simulator's about 10). Then, in this process on uvloop, each client in turn makes ``--calls``
sequential keep-alive GETs of each path (rounds rotate the order); CPU is this process's user +
system time over the calls, divided by the calls.

    flock /tmp/bench.lock python -m benchmarks.http_clients [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import aiohttp
import httpx

from benchmarks.overhead import HOST, free_port, process
from router.upstream.client import UpstreamClient

PATHS = ("/v1/models", "/metrics", "/metrics-vllm")
CLIENTS = ("own", "aiohttp", "httpx")
TIMEOUT = 5.0

Get = Callable[[str], Awaitable[tuple[int, bytes]]]


def padded_page(page: bytes, size: int) -> bytes:
    """``page`` followed by histogram families in vLLM's shape until it is ``size`` bytes."""
    parts = [page]
    total, family = len(page), 0
    buckets = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
               "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf")
    while total < size:
        name = f"vllm:pad_{family}_seconds"
        lines = [f"# HELP {name} Histogram of a padding series.", f"# TYPE {name} histogram"]
        labels = 'engine="0",model_name="sim-model"'
        lines += [f'{name}_bucket{{{labels},le="{le}"}} {n}.0' for n, le in enumerate(buckets)]
        lines += [f"{name}_count{{{labels}}} 19.0", f"{name}_sum{{{labels}}} 12.5"]
        chunk = ("\n".join(lines) + "\n").encode()
        parts.append(chunk)
        total += len(chunk)
        family += 1
    return b"".join(parts)


def serve(port: int, page_kb: int) -> None:
    """The replica with ``/metrics-vllm`` (the child process)."""
    import uvicorn
    from prometheus_client import generate_latest
    from starlette.requests import Request
    from starlette.responses import Response

    from benchmarks.sim.config import SimConfig
    from benchmarks.sim.server import create_app

    app = create_app(SimConfig(), port=port)
    sim = app.state.sim

    async def vllm_sized(request: Request) -> Response:
        page = padded_page(generate_latest(sim.metrics.registry), page_kb * 1024)
        return Response(page, media_type="text/plain; version=0.0.4")

    app.add_route("/metrics-vllm", vllm_sized)
    uvicorn.run(app, host=HOST, port=port, log_level="warning", loop="uvloop", http="httptools")


@dataclass
class Result:
    cpu_us: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    size: int = 0


async def measure(get: Get, url: str, calls: int) -> tuple[float, float, float, int]:
    """(CPU us per call, p50 ms, p99 ms, body bytes) of ``calls`` sequential GETs."""
    for _ in range(min(200, calls)):  # warm: connections, caches
        await get(url)
    latencies: list[float] = []
    size = 0
    cpu = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        status, body = await get(url)
        latencies.append(time.perf_counter() - start)
        if status != 200:
            raise RuntimeError(f"{url}: {status}")
        size = len(body)
    cpu_us = (time.process_time() - cpu) / calls * 1e6
    cuts = statistics.quantiles(latencies, n=100)
    return cpu_us, cuts[49] * 1e3, cuts[98] * 1e3, size


async def clients(stack: AsyncExitStack) -> dict[str, Get]:
    """Each client the way the gateway uses (or would use) it, with a timeout per call."""
    own = UpstreamClient(64, TIMEOUT)
    stack.push_async_callback(own.aclose)
    session = await stack.enter_async_context(
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    )
    hx = await stack.enter_async_context(httpx.AsyncClient(timeout=TIMEOUT))

    async def own_get(url: str) -> tuple[int, bytes]:
        got = await own.fetch("GET", url, seconds=TIMEOUT)
        return got.status, got.body

    async def aiohttp_get(url: str) -> tuple[int, bytes]:
        async with asyncio.timeout(TIMEOUT), session.get(url) as resp:
            return resp.status, await resp.read()

    async def httpx_get(url: str) -> tuple[int, bytes]:
        resp = await hx.get(url)
        return resp.status_code, resp.content

    return {"own": own_get, "aiohttp": aiohttp_get, "httpx": httpx_get}


async def run(base: str, calls: int, rounds: int) -> dict[tuple[str, str], Result]:
    results = {(c, p): Result() for c in CLIENTS for p in PATHS}
    async with AsyncExitStack() as stack:
        gets = await clients(stack)
        for r in range(rounds):
            order = CLIENTS[r % len(CLIENTS):] + CLIENTS[: r % len(CLIENTS)]
            for name in order:
                for path in PATHS:
                    cpu, p50, p99, size = await measure(gets[name], base + path, calls)
                    res = results[(name, path)]
                    res.cpu_us.append(cpu)
                    res.p50_ms.append(p50)
                    res.p99_ms.append(p99)
                    res.size = size
    return results


def table(results: dict[tuple[str, str], Result]) -> str:
    rows = ["| path (body) | client | CPU us/call, median (range) | p50 ms | p99 ms |",
            "|---|---|---|---|---|"]
    for path in PATHS:
        for name in CLIENTS:
            r = results[(name, path)]
            rows.append(
                f"| `{path}` ({r.size / 1024:.1f} KB) | {name} | {statistics.median(r.cpu_us):.0f}"
                f" ({min(r.cpu_us):.0f}-{max(r.cpu_us):.0f}) | "
                f"{statistics.median(r.p50_ms):.3f} | {statistics.median(r.p99_ms):.3f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="GETs per client, path, round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-kb", type=int, default=48, help="size of /metrics-vllm")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.page_kb)
        return 0
    import uvloop

    port = free_port()
    child = [sys.executable, "-m", "benchmarks.http_clients", "--serve", str(port),
             "--page-kb", str(args.page_kb)]
    base = f"http://{HOST}:{port}"
    with process(child, f"{base}/health"):
        results = uvloop.run(run(base, args.calls, args.rounds))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
