"""Child processes of a benchmark (replicas, gateways, peers, Redis): started with their output
in a log file, awaited until an HTTP probe answers, always stopped (TERM, then KILL)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port_range(n: int, first: int = 21000, last: int = 60000) -> int:
    """A base port with ``n`` consecutive free ports after it (racy, as any port probe)."""
    step = max(n, 16)
    for base in range(first, last - n, step):
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {first}..{last}")


class Process:
    """One child process; ``stop`` is idempotent."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def exited(self) -> bool:
        return self.proc.poll() is not None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, STOP_TIMEOUT_S)
        self._log.close()


Probe = Callable[[aiohttp.ClientSession], Awaitable[bool]]


def http_ok(url: str) -> Probe:
    async def probe(http: aiohttp.ClientSession) -> bool:
        async with http.get(url) as resp:
            return resp.status == 200

    return probe


async def wait_ready(procs: Sequence[Process], probes: Sequence[Probe], timeout_s: float) -> None:
    """Until every probe passes; fails at once when a process exits, or at the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = list(probes)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while pending:
            for proc in procs:
                if proc.exited:
                    raise RuntimeError(
                        f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}"
                    )
            still = []
            for probe in pending:
                ok = False
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    ok = await probe(http)
                if not ok:
                    still.append(probe)
            pending = still
            if pending:
                if loop.time() > deadline:
                    names = ", ".join(p.name for p in procs)
                    raise RuntimeError(f"{names} not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.2)
