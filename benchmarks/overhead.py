"""What the gateway adds: req/s and latency through it vs straight to a replica, side by side.

Starts a zero-latency simulated replica and a gateway in front of it, each in its own process
(so neither shares an event loop with the load generator), then runs a closed-loop load for
non-streaming and streaming requests at 1 and 32 connections against both.

    python -m benchmarks.overhead [--seconds 4] [--connections 1 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import orjson

from benchmarks.loadgen import LoadResult, run_load

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


@contextlib.contextmanager
def process(args: list[str], ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_ready(ready_url)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def body(stream: bool) -> bytes:
    messages = [{"role": "user", "content": "Summarise the design of a routing gateway. " * 8}]
    return orjson.dumps(
        {"model": "sim-model", "messages": messages, "max_tokens": 16, "stream": stream}
    )


def row(label: str, direct: LoadResult, via: LoadResult) -> str:
    added_p50 = (via.percentile(50) - direct.percentile(50)) * 1000
    added_p99 = (via.percentile(99) - direct.percentile(99)) * 1000
    return (
        f"| {label} | {direct.rps:,.0f} | {via.rps:,.0f} | {direct.percentile(50) * 1000:.2f} | "
        f"{via.percentile(50) * 1000:.2f} | {added_p50:+.2f} | {added_p99:+.2f} | "
        f"{direct.errors + via.errors} |"
    )


async def measure(sim_port: int, gw_port: int, connections: list[int], seconds: float) -> None:
    print("| mode, connections | direct req/s | gateway req/s | direct p50 ms | gateway p50 ms "
          "| added p50 ms | added p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for stream in (False, True):
        for conns in connections:
            payload = body(stream)
            path = "/v1/chat/completions"
            direct = await run_load(HOST, sim_port, path, payload, conns, seconds)
            via = await run_load(HOST, gw_port, path, payload, conns, seconds)
            label = f"{'streaming' if stream else 'non-streaming'}, {conns}"
            print(row(label, direct, via), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="per run (2 runs per row)")
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args(argv)
    sim_port, gw_port = free_port(), free_port()
    exe = [sys.executable, "-m", "router.cli"]
    sim = [*exe, "sim", "--zero-latency", "--host", HOST, "--port", str(sim_port),
           "--log-level", "warning"]
    gateway = [*exe, "serve", "--backend", f"http://{HOST}:{sim_port}", "--host", HOST,
               "--port", str(gw_port), "--log-level", "warning"]
    with process(sim, f"http://{HOST}:{sim_port}/health"), process(
        gateway, f"http://{HOST}:{gw_port}/ready"
    ):
        asyncio.run(measure(sim_port, gw_port, args.connections, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
