"""A private three-primary Redis Cluster for the tests, on free loopback ports.

``redis-server`` in cluster mode, three processes without persistence, their slots assigned
and joined over the cluster bus with plain commands (no ``redis-cli --cluster``). Started once
per test session and killed at its end. Without a ``redis-server`` binary the cluster tests
skip, except under CI (env ``CI`` set), where that is a failure: ``.ci/run`` installs one.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import redis

from tests.redis_server import START_TIMEOUT, answers, started

NODES = 3
SLOTS = 16384


def _free_cluster_port() -> int:
    # The cluster bus listens on port + 10000, which must be free (and valid) too.
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            if port + 10000 > 65535:
                continue
            bus = stack.enter_context(socket.socket())
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis Cluster: {what} within {START_TIMEOUT} s")
        time.sleep(0.05)


def _cluster_ok(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and f"cluster_known_nodes:{NODES}" in text
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _form(ports: list[int]) -> None:
    per = SLOTS // len(ports)
    for i, port in enumerate(ports):
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        try:
            last = SLOTS - 1 if i == len(ports) - 1 else (i + 1) * per - 1
            client.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "ADDSLOTSRANGE", i * per, last
            )
            if i:
                client.execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER", "MEET", "127.0.0.1", ports[0]
                )
        finally:
            client.close()
    for port in ports:
        _wait(functools.partial(_cluster_ok, port), "not formed")


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """Three cluster-mode ``redis-server`` processes; yields the first node's URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server binary for a Redis Cluster")
    ports = [_free_cluster_port() for _ in range(NODES)]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-cluster-") as workdir:
        try:
            for port in ports:
                args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", workdir, "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{port}.conf"]
                procs.append(
                    subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
            for port in ports:
                _wait(functools.partial(answers, f"redis://127.0.0.1:{port}/0", 0.2), "no answer")
            _form(ports)
            yield f"redis://127.0.0.1:{ports[0]}/0"
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=5)


@contextlib.contextmanager
def redis_cluster_url() -> Iterator[str]:
    """A Redis Cluster URL for the session; skip (or fail under CI) when none can be had."""
    with started(private_cluster) as url:
        yield url
