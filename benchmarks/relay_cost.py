"""What relaying a stream costs the gateway: CPU seconds per chunk, read from /proc.

A streamed answer reaches the gateway one engine step (one token) at a time, and each chunk is
read, relayed and written on the gateway's one event loop. On a busy fleet that, not routing,
is most of the gateway's CPU. This starts one simulated replica (real step timing, sped up) and
a router in front of it, each in its own process, runs rounds of streaming requests through the
router, and divides the router process's CPU time (user + system) by the chunks the client
received. ``--smg PATH`` measures smg's binary the same way instead of prefixgate.

    python -m benchmarks.relay_cost [--rounds 3] [--requests 96] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

from benchmarks.overhead import HOST, free_port, process

MAX_TOKENS = 300


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(client: httpx.AsyncClient, n: int) -> int:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"request {n}: " + "tell me more " * 20}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for _ in reply.aiter_raw():
            chunks += 1
    return chunks


async def load(url: str, requests: int, concurrency: int) -> int:
    """Chunks received over ``requests`` streams, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, n: int) -> int:
        async with gate:
            return await _stream(client, n)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        counts = await asyncio.gather(*(one(client, n) for n in range(requests)))
    return sum(counts)


def router_args(smg: str | None, port: int, replica: str) -> tuple[list[str], str]:
    if smg is not None:
        args = [smg, "launch", "--host", HOST, "--port", str(port), "--worker-urls", replica,
                "--policy", "cache_aware", "--backend", "vllm", "--log-level", "warn",
                "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        return args, f"http://{HOST}:{port}/health"
    args = [sys.executable, "-m", "router.cli", "serve", "--backend", replica, "--host", HOST,
            "--port", str(port), "--log-level", "warning"]
    return args, f"http://{HOST}:{port}/ready"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96, help="streams per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--speed", type=float, default=4.0, help="the replica's speed-up")
    parser.add_argument("--smg", help="measure this smg binary instead of prefixgate")
    args = parser.parse_args(argv)
    sim_port, port = free_port(), free_port()
    replica = f"http://{HOST}:{sim_port}"
    sim = [sys.executable, "-m", "router.cli", "sim", "--host", HOST, "--port", str(sim_port),
           "--speed", str(args.speed), "--log-level", "warning"]
    router, ready = router_args(args.smg, port, replica)
    url = f"http://{HOST}:{port}"
    with process(sim, f"{replica}/health"), process(router, ready) as proc:
        asyncio.run(load(url, args.concurrency, args.concurrency))  # warm up
        print("| round | chunks | wall s | router CPU s | us per chunk |")
        print("|---|---|---|---|---|")
        for n in range(args.rounds):
            cpu, wall = cpu_seconds(proc.pid), time.perf_counter()
            chunks = asyncio.run(load(url, args.requests, args.concurrency))
            cpu, wall = cpu_seconds(proc.pid) - cpu, time.perf_counter() - wall
            print(f"| {n + 1} | {chunks:,} | {wall:.1f} | {cpu:.2f} | {cpu / chunks * 1e6:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
