"""``prefixgate serve --workers 2`` as real processes on loopback: both workers serve, a
session sticks to one replica whichever worker takes its requests, a killed worker is replaced,
and SIGTERM drains and stops every process (workers and the private Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgpack
import pytest
import redis.asyncio
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.errors import ConfigError
from router.protocol.headers import DESTINATION_HEADER
from router.serve.private_redis import private_redis
from router.serve.supervisor import (
    PRIVATE_REDIS_TIMEOUT_MS,
    RestartPolicy,
    Supervisor,
    needs_private_redis,
    shared_config,
)
from tests.gateways import MODEL, gateway_config
from tests.processes import gateway_process
from tests.redis_server import unavailable

T = TypeVar("T")
POLL_S = 0.05
BOUND_S = 30.0  # generous: imports and start-up are slow on a busy 2-core box


async def _poll(probe: Callable[[], Awaitable[T]], until: Callable[[T], bool]) -> T:
    result = await probe()
    for _ in range(int(BOUND_S / POLL_S)):
        if until(result):
            return result
        await asyncio.sleep(POLL_S)
        result = await probe()
    return result


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid``: pid -> command name (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(entry.name)] = comm
    return out


def _workers(pid: int) -> set[int]:
    return {p for p, comm in _children(pid).items() if not comm.startswith("redis")}


async def _per_worker(url: str, name: str) -> dict[str, float]:
    """A metric summed per worker label, from one scrape of the merged /metrics."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return {}  # no worker listening at this instant (starting, or being replaced)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                worker = sample.labels["worker"]
                out[worker] = out.get(worker, 0.0) + sample.value
    return out


def _all_up(up: dict[str, float]) -> bool:
    return up == {"0": 1.0, "1": 1.0}


def _chat(session: str) -> dict[str, Any]:
    # Long enough to fill blocks: a prompt of no block gives its endpoint no reason but the
    # affinity, which a moment's in-flight count on another worker's view may outweigh.
    content = f"a session that must stay home {session} " * 200
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


@pytest.fixture
def pool_config() -> Callable[[list[str]], dict[str, Any]]:
    def make(urls: list[str]) -> dict[str, Any]:
        data: dict[str, Any] = gateway_config(urls).model_dump(by_alias=True, exclude_unset=True)
        data["server"] = {"workers": 2}
        return data

    return make


async def _subscribed(pubsub: Any, namespace: str) -> None:
    """Listen to the workers' replication channel; back once Redis confirmed it."""
    await pubsub.subscribe("{pg:" + namespace + "}:replicate")
    confirmed = await _poll(
        lambda: pubsub.get_message(timeout=0.05), lambda m: m is not None
    )
    assert confirmed is not None and confirmed["type"] == "subscribe"


async def _session_shared(
    client: Any, pubsub: Any, backend: str, namespace: str, gateway_url: str
) -> bool:
    """Whether the session's endpoint and its prompt's blocks reached where the other worker
    reads them: Redis's keys, or (replicated) ops published on the workers' channel. Before
    that, the other worker may fairly route the session elsewhere. Replicated ops must also
    have been applied by the other worker."""
    if backend == "redis":
        tag = "{pg:" + namespace + "}"

        async def stored() -> bool:
            return bool(await client.exists(f"pg:{namespace}:sess:s1")) and bool(
                await client.hlen(tag + ":h")
            )

        return bool(await _poll(stored, bool))
    kinds: set[str] = set()

    async def published() -> set[str]:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if message is not None:
            kinds.update(op[0] for op in msgpack.unpackb(message["data"])[1])
        return kinds

    if await _poll(published, lambda k: {"r", "s"} <= k) != {"r", "s"}:
        return False
    # Published is not applied: on a loaded machine the other worker's subscription may read
    # the batch later than the next request reaches it. Its counter says when it has.
    applied = await _poll(lambda: _applied_kinds(gateway_url), lambda k: {"r", "s"} <= k)
    return {"r", "s"} <= applied


async def _applied_kinds(url: str) -> set[str]:
    """The update kinds some worker has applied from another's replication batches."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"{url}/metrics")).text
    except httpx.HTTPError:
        return set()
    return {
        sample.labels["kind"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "prefixgate_replicated_ops_applied_total" and sample.value > 0
    }


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("backend", ["redis", "replicated"])
async def test_two_workers_serve_and_a_session_sticks_across_them(
    tmp_path: Path, redis_url: str, redis_namespace: str, backend: str,
    pool_config: Callable[[list[str]], dict[str, Any]],
) -> None:
    async with start_replicas(4, SimConfig(speed=50.0)) as replicas:
        config = pool_config([r.url for r in replicas])
        # Routed by what the workers share only (the session's endpoint, then its prefix): the
        # default cost model also weighs each worker's own view of the load, and one worker
        # does not see the other's requests in flight, so under load it may fairly send the
        # session elsewhere once. Here that would be noise; the subject is the shared state.
        config["plugins"] = [
            {"type": "session-affinity-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker"},
        ]
        config["schedulingProfiles"] = [{"name": "default", "plugins": [
            {"pluginRef": "session-affinity-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 1},
            {"pluginRef": "max-score-picker"},
        ]}]
        # A generous budget: on a loaded machine a 5 ms one can time out, and the local
        # fallback is not what this test is about.
        config["prefixIndex"] = {
            "backend": backend, "url": redis_url, "namespace": redis_namespace, "timeoutMs": 2000
        }
        async with (
            gateway_process(tmp_path, config) as gw,
            redis.asyncio.Redis.from_url(redis_url) as client,
            client.pubsub() as pubsub,
        ):
            up = await _poll(lambda: _per_worker(gw.url, "prefixgate_worker_up"), _all_up)
            assert _all_up(up)
            await _subscribed(pubsub, redis_namespace)
            served: dict[str, float] = {}
            homes: list[str] = []
            for _ in range(200):  # each on a new connection, which the kernel hashes to a worker
                async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                    resp = await http.post(
                        "/v1/chat/completions", json=_chat("s1"), headers={"x-session-id": "s1"}
                    )
                assert resp.status_code == 200, resp.text
                homes.append(resp.headers[DESTINATION_HEADER])
                if len(homes) == 1:  # the next worker must find the session
                    assert await _session_shared(client, pubsub, backend, redis_namespace, gw.url)
                served = await _per_worker(gw.url, "prefixgate_requests_total")
                if len(homes) >= 10 and len(served) == 2 and min(served.values()) > 0:
                    break
            gw.proc.send_signal(signal.SIGTERM)  # a clean stop removes its run directory
            async with asyncio.timeout(BOUND_S):
                assert await gw.proc.wait() == 0
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served
        assert set(homes) == {homes[0]}, homes


@pytest.mark.slow
async def test_killed_worker_is_replaced_and_sigterm_stops_everything(
    tmp_path: Path, pool_config: Callable[[list[str]], dict[str, Any]],
) -> None:
    async with start_replicas(2, SimConfig(speed=20.0)) as replicas:
        config = pool_config([r.url for r in replicas])
        config["server"] |= {"shutdownDelaySeconds": 0.5, "drainTimeoutSeconds": 10}
        async with gateway_process(tmp_path, config) as gw:
            supervisor = gw.proc.pid
            up = await _poll(lambda: _per_worker(gw.url, "prefixgate_worker_up"), _all_up)
            assert _all_up(up), "both workers serve before one is killed"
            first = _workers(supervisor)
            assert len(first) == 2
            assert any(c.startswith("redis") for c in _children(supervisor).values())
            victim = min(first)
            os.kill(victim, signal.SIGKILL)
            now = await _poll(
                lambda: _async(_workers, supervisor), lambda w: len(w) == 2 and victim not in w
            )
            assert len(now) == 2 and victim not in now
            up = await _poll(lambda: _per_worker(gw.url, "prefixgate_worker_up"), _all_up)
            assert _all_up(up), "the replacement serves its metrics"
            everyone = set(_children(supervisor))
            async with httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
                body = {**_chat("drain"), "max_tokens": 2000, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    stream = resp.aiter_bytes()
                    chunks = [await anext(stream)]
                    gw.proc.send_signal(signal.SIGTERM)
                    chunks += [chunk async for chunk in stream]
            async with asyncio.timeout(BOUND_S):
                code = await gw.proc.wait()
    assert b"".join(chunks).rstrip().endswith(b"data: [DONE]"), "the stream drained"
    assert code == 0
    assert not set(everyone) & set(_children(supervisor)), "no process left"
    assert "restarting" in gw.log_path.read_text()


async def test_the_private_redis_exiting_stops_the_workers_with_a_failure(
    tmp_path: Path, pool_config: Callable[[list[str]], dict[str, Any]],
) -> None:
    """Without it the workers would go on as separate gateways, silently: the supervisor
    stops them all and exits 1, for the orchestrator to restart the whole."""
    async with start_replicas(1, SimConfig(speed=20.0)) as replicas:
        config = pool_config([r.url for r in replicas])
        config["server"] |= {"shutdownDelaySeconds": 0, "drainTimeoutSeconds": 5}
        async with gateway_process(tmp_path, config) as gw:
            supervisor = gw.proc.pid
            up = await _poll(lambda: _per_worker(gw.url, "prefixgate_worker_up"), _all_up)
            assert _all_up(up)
            redis_pid = next(p for p, c in _children(supervisor).items() if c.startswith("redis"))
            os.kill(redis_pid, signal.SIGKILL)
            async with asyncio.timeout(BOUND_S):
                code = await gw.proc.wait()
    assert code == 1
    assert not _children(supervisor), "no worker left, and the redis-server reaped"
    assert "private redis-server the workers share exited" in gw.log_path.read_text()


async def _async(fn: Callable[[int], T], arg: int) -> T:
    return fn(arg)


def test_restart_policy_backs_off_and_gives_up() -> None:
    now = [0.0]
    policy = RestartPolicy(clock=lambda: now[0], max_restarts=3, window=60.0)
    assert [policy.crashed(0) for _ in range(3)] == [0.1, 0.2, 0.4]
    assert policy.crashed(1) == 0.1, "slots are counted apart"
    assert policy.crashed(0) is None, "a fourth crash within the window: give up"
    now[0] = 61.0
    assert policy.crashed(0) == 0.1, "old crashes leave the window"


def test_more_workers_without_redis_fail_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = gateway_config(["http://127.0.0.1:9"], server={"workers": 2})
    assert needs_private_redis(config)
    assert not needs_private_redis(gateway_config(["http://127.0.0.1:9"]))
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    with pytest.raises(ConfigError, match=r"prefixIndex\.backend: replicated"), private_redis(
        tmp_path, 2
    ):
        pass


@pytest.mark.slow
def test_a_config_error_in_the_workers_stops_the_gateway_with_exit_2(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        unavailable("no redis-server for the private Redis")
    env_name = "PREFIXGATE_TEST_NEVER_SET"
    path = tmp_path / "gateway.yaml"
    path.write_text(
        f"server: {{port: 0, workers: 2}}\n"
        f"pool: {{apiKeyEnv: {env_name}, endpoints: [{{url: 'http://127.0.0.1:9'}}]}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != env_name}
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=BOUND_S * 2, env=env,
    )
    assert done.returncode == 2, done.stderr
    assert f"pool.apiKeyEnv: environment variable {env_name}" in done.stderr
    assert "crashed" not in done.stderr, "not restarted in a loop"


def test_workers_config_takes_the_port_and_the_private_redis() -> None:
    config = gateway_config(["http://127.0.0.1:9"], server={"workers": 2, "port": 0})
    shared = shared_config(config, "unix:///run/r.sock", 8123)
    assert shared.server.port == 8123 and shared.server.workers == 2
    index = shared.prefix_index
    assert (index.backend, index.url) == ("replicated", "unix:///run/r.sock")
    assert shared.prefix_index.timeout_ms == PRIVATE_REDIS_TIMEOUT_MS
    mine = gateway_config(
        ["http://127.0.0.1:9"], server={"workers": 2}, prefixIndex={"timeoutMs": 7}
    )
    assert shared_config(mine, "unix:///run/r.sock", 1).prefix_index.timeout_ms == 7
    assert shared_config(mine, None, 1).prefix_index.backend == "memory"


@pytest.mark.slow
def test_a_config_error_found_at_start_up_in_the_workers_exits_2_without_restarts(
    tmp_path: Path,
) -> None:
    """Kubernetes discovery outside a cluster is a configuration error found in the lifespan
    (not while building the gateway): it stops the gateway with exit 2 as well, not after a
    crash loop of restarts."""
    if shutil.which("redis-server") is None:
        unavailable("no redis-server for the private Redis")
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "server: {port: 0, workers: 2}\n"
        "discovery: {inferencePool: pool, initialSyncTimeoutSeconds: 0}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=BOUND_S * 2, env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "prefixgate: discovery.apiServer: not set" in done.stderr
    assert "restarting" not in done.stderr, "not restarted in a loop"


@pytest.mark.parametrize(("code", "exit_code"), [(0, 0), (-signal.SIGTERM, 0), (1, 1)])
def test_a_worker_ended_by_the_stop_signal_itself_is_a_clean_stop(
    tmp_path: Path, code: int, exit_code: int
) -> None:
    """A worker still starting (or already past its drain) has SIGTERM's default action and
    dies of the SIGTERM the stop sends it: nothing was in flight there, and the gateway's exit
    code (systemd marks a unit failed on 1) must not say otherwise."""
    config = gateway_config(["http://127.0.0.1:9"], server={"workers": 2})
    supervisor = Supervisor(config, tmp_path, "info", None)
    supervisor.stop("signal")  # no worker started: nothing is sent
    supervisor._exited(0, 12345, code)
    supervisor._wake_r.close()
    supervisor._wake_w.close()
    assert supervisor._code == exit_code
