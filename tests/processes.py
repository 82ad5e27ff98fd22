"""A real ``python -m router.cli serve`` process for tests that need separate gateways.

Each process gets its own YAML config on a free loopback port, logs to a file in the test's
temporary directory, and is killed (bounded wait) when the context exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.e2e.test_reliability_faults import free_port


@dataclass(frozen=True)
class GatewayProcess:
    proc: asyncio.subprocess.Process
    url: str
    log_path: Path


def _tail(log_path: Path) -> str:
    return log_path.read_text()[-2000:]


async def _wait_ready(proc: asyncio.subprocess.Process, url: str, log_path: Path) -> None:
    async with httpx.AsyncClient(timeout=1) as http:
        for _ in range(600):  # 30 s: imports are slow on a busy 2-core box
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/ready")).status_code == 200:
                    return
            assert proc.returncode is None, _tail(log_path)
            await asyncio.sleep(0.05)
    raise AssertionError(f"the gateway did not become ready: {_tail(log_path)}")


@contextlib.asynccontextmanager
async def gateway_process(
    tmp_path: Path, config: dict[str, Any], name: str = "gateway"
) -> AsyncIterator[GatewayProcess]:
    """Start a gateway on ``config`` (its ``server`` host and port are set here)."""
    port = free_port()
    server = {**config.get("server", {}), "host": "127.0.0.1", "port": port}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "server": server}))
    log_path = tmp_path / f"{name}.log"
    args = ["-m", "router.cli", "serve", "--config", str(path),
            "--log-level", "info", "--log-format", "json"]
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=subprocess.DEVNULL, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(proc, url, log_path)
        yield GatewayProcess(proc, url, log_path)
    finally:
        if proc.returncode is None:
            proc.kill()
        async with asyncio.timeout(10):
            await proc.wait()
