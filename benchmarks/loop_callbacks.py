"""The longest event-loop callbacks of a gateway while it serves one huge request.

benchmarks.loop_stall reads the gateway's loop-lag histogram, which also counts the time the
process waited for a core; on a shared machine that hides what the gateway itself does. This
runs a gateway in this process, times every callback of its event loop in thread CPU time
(``time.thread_time``: no waiting for a core) and in wall time, and prints the longest ones.
A zero-latency simulated replica answers; curl sends the body, from a process of its own.

    python -m benchmarks.loop_callbacks [--mb 30] [--messages 0] [--top 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from asyncio import events
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench.procs import HOST, free_port
from benchmarks.loop_stall import body
from benchmarks.overhead import started
from router.config.model import GatewayConfig
from router.serve.server import running_gateway

Timing = tuple[float, float, str]  # (thread CPU s, wall s, the callback)


def timed_handles(record: list[Timing]) -> Callable[[], None]:
    """Time every event-loop callback into ``record``; returns the undo."""
    run = events.Handle._run

    def timed(handle: events.Handle) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            run(handle)
        finally:
            record.append((time.thread_time() - cpu, time.perf_counter() - wall, repr(handle)))

    setattr(events.Handle, "_run", timed)  # noqa: B010 (a method of the stdlib's class)
    return lambda: setattr(events.Handle, "_run", run)


async def post(url: str, path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-s", "-o", "/dev/null", "-H", "content-type: application/json",
        "--data-binary", f"@{path}", f"{url}/v1/chat/completions",
    )
    await proc.wait()


async def measure(payload: bytes, tmp: Path) -> list[Timing]:
    small, big = tmp / "small.json", tmp / "big.json"
    small.write_bytes(body(0.001, 0))
    big.write_bytes(payload)
    replica = f"http://{HOST}:{free_port()}"
    port = replica.rsplit(":", 1)[1]
    sim = [sys.executable, "-m", "router.cli", "sim", "--zero-latency", "--host", HOST,
           "--port", port, "--log-level", "warning"]
    config = GatewayConfig.model_validate({
        "pool": {"endpoints": [{"url": replica}]},
        "server": {"host": HOST, "port": 0, "accessLog": False},
    })
    record: list[Timing] = []
    with started("replica", sim, [f"{replica}/health"], replica):
        async with running_gateway(config) as gateway:
            await post(gateway.url, small)  # warm-up
            undo = timed_handles(record)
            try:
                await post(gateway.url, big)
                await asyncio.sleep(0.5)  # what the request left behind (index pieces)
            finally:
                undo()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=30.0, help="request body size")
    parser.add_argument("--messages", type=int, default=0, help="0: one long message")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    payload = body(args.mb, args.messages)
    with tempfile.TemporaryDirectory() as tmp:
        record = asyncio.run(measure(payload, Path(tmp)))
    record.sort(reverse=True)
    print(f"body {len(payload) / 1e6:.1f} MB, {args.messages or 1} message(s): "
          f"{len(record)} callbacks; longest in thread CPU (ms CPU / ms wall):")
    for cpu, wall, what in record[: args.top]:
        print(f"  {cpu * 1e3:6.1f} / {wall * 1e3:6.1f}  {what[:100]}")
    walls = sorted((w for _, w, _ in record), reverse=True)[: args.top]
    print("longest in wall time (ms):", ", ".join(f"{w * 1e3:.1f}" for w in walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
