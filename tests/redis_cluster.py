"""A private three-primary Redis Cluster for the tests, on free loopback ports.

``redis-server`` in cluster mode, three processes without persistence, their slots assigned
and joined over the cluster bus with plain commands (no ``redis-cli --cluster``). Started once
per test session and killed at its end; a failover test starts one of its own with a replica
for each primary and a short node timeout. Without a ``redis-server`` binary, or when the nodes
do not answer or form within ``START_TIMEOUT`` (each step), the cluster tests skip with the
reason, except under CI (env ``CI`` set), where that is a failure: ``.ci/run`` sets CI.
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
from dataclasses import dataclass

import redis
from redis.crc import key_slot

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


def _cluster_ok(port: int, nodes: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and f"cluster_known_nodes:{nodes}" in text
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def command(port: int, *args: object) -> object:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    try:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _replicating(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
    try:
        return client.info("replication").get("master_link_status") == "up"
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _form(primaries: list[int], replicas: list[int]) -> None:
    per = SLOTS // len(primaries)
    for i, port in enumerate(primaries):
        last = SLOTS - 1 if i == len(primaries) - 1 else (i + 1) * per - 1
        command(port, "CLUSTER", "ADDSLOTSRANGE", i * per, last)
    for port in primaries[1:] + replicas:
        command(port, "CLUSTER", "MEET", "127.0.0.1", primaries[0])
    nodes = len(primaries) + len(replicas)
    for port in primaries + replicas:
        _wait(functools.partial(_cluster_ok, port, nodes), "not formed")
    for primary, replica in zip(primaries, replicas, strict=False):
        node_id = command(primary, "CLUSTER", "MYID")
        text = node_id.decode() if isinstance(node_id, bytes) else str(node_id)
        command(replica, "CLUSTER", "REPLICATE", text)
    for port in replicas:
        _wait(functools.partial(_replicating, port), "replica not in sync")


@dataclass
class PrivateCluster:
    """The running nodes: primaries first (their slot ranges in order), then replicas."""

    primaries: list[int]
    replicas: list[int]
    procs: dict[int, subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries[0]}/0"

    def primary_of(self, key: str) -> int:
        per = SLOTS // len(self.primaries)
        return self.primaries[min(key_slot(key.encode()) // per, len(self.primaries) - 1)]

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=5)


@contextlib.contextmanager
def private_cluster(
    replicas: bool = False, node_timeout_ms: int = 15_000
) -> Iterator[PrivateCluster]:
    """Three cluster-mode ``redis-server`` primaries, each with a replica if asked."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no redis-server binary for a Redis Cluster")
    primaries = [_free_cluster_port() for _ in range(NODES)]
    followers = [_free_cluster_port() for _ in range(NODES if replicas else 0)]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="prefixgate-cluster-") as workdir:
        try:
            for port in primaries + followers:
                args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", workdir, "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(node_timeout_ms),
                        # A replica's first sync starts at once, not after the default 5-s
                        # wait for other replicas to share it (diskless sync's delay).
                        "--repl-diskless-sync-delay", "0"]
                procs[port] = subprocess.Popen(
                    args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            for port in procs:
                _wait(functools.partial(answers, f"redis://127.0.0.1:{port}/0", 0.2), "no answer")
            _form(primaries, followers)
            yield PrivateCluster(primaries, followers, procs)
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(timeout=5)


@contextlib.contextmanager
def _cluster_url() -> Iterator[str]:
    with private_cluster() as cluster:
        yield cluster.url


@contextlib.contextmanager
def redis_cluster_url() -> Iterator[str]:
    """A Redis Cluster URL for the session; skip (or fail under CI) when none can be had."""
    with started(_cluster_url) as url:
        yield url


@contextlib.contextmanager
def failover_cluster() -> Iterator[PrivateCluster]:
    """A cluster of its own, with replicas and a 500-ms node timeout, for a test that kills a
    primary; skip (or fail under CI) when none can be had."""
    with started(functools.partial(private_cluster, True, 500)) as cluster:
        yield cluster
