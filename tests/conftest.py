"""Fixtures shared by all test directories."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.protocol.parsing import Api, ParsedRequest
from router.scheduling import routing
from router.serve.server import RunningGateway, running_gateway
from tests.gateways import Parses, gateway_config
from tests.redis_cluster import redis_cluster_url as cluster_url
from tests.redis_server import namespace_for, redis_server_url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server URL (see tests/redis_server.py); skips the test when none can be had."""
    with redis_server_url() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A node of a private three-primary Redis Cluster (tests/redis_cluster.py)."""
    with cluster_url() as url:
        yield url


@pytest.fixture
async def redis_namespace(redis_url: str) -> AsyncIterator[str]:
    """A namespace unique to the test; its keys are deleted afterwards."""
    async with namespace_for(redis_url) as namespace:
        yield namespace


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    """Four simulated replicas on loopback sockets."""
    async with start_replicas(4, SimConfig(speed=20.0)) as reps:
        yield reps


@pytest.fixture
async def gateway(replicas: list[Replica]) -> AsyncIterator[RunningGateway]:
    """A gateway in front of ``replicas``, on a loopback socket."""
    async with running_gateway(gateway_config([r.url for r in replicas])) as gw:
        yield gw


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=test",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Parses:
    """Records each parse of a request body by routing (where large bodies are parsed)."""
    seen = Parses()
    parse = routing.parse_request

    def spy(api: Api, body: bytes) -> ParsedRequest:
        seen.append((len(body), threading.current_thread()))
        return parse(api, body)

    monkeypatch.setattr(routing, "parse_request", spy)
    return seen
