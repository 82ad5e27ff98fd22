"""A minimal HTTP/1.1 keep-alive load generator on asyncio streams.

Python HTTP clients cost more per request than the gateway being measured; this one only
writes a fixed request and reads the response (content-length or chunked), so that on a small
machine the numbers say more about the server than about the client.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response; returns its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            headers[k.strip().lower()] = v.strip()
    if b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def _worker(
    host: str, port: int, request: bytes, deadline: float, result: LoadResult
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            writer.write(request)
            status = await read_response(reader)
            if status == 200:
                result.latencies.append(time.perf_counter() - started)
            else:
                result.errors += 1
    finally:
        writer.close()


async def run_load(
    host: str, port: int, path: str, body: bytes, connections: int, seconds: float
) -> LoadResult:
    """Closed loop: each connection sends its next request when the last one is answered."""
    result = LoadResult()
    request = build_request(host, port, path, body)
    warm = LoadResult()
    await asyncio.gather(
        *(_worker(host, port, request, time.perf_counter() + 0.3, warm) for _ in range(connections))
    )
    started = time.perf_counter()
    deadline = started + seconds
    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(
            *(_worker(host, port, request, deadline, result) for _ in range(connections))
        )
    result.elapsed = time.perf_counter() - started
    return result
