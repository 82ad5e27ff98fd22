"""Kubernetes discovery against a fake API server on loopback (list + watch streams)."""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
from aiohttp import web

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.config.model import DiscoveryConfig
from router.core.endpoints import Endpoint
from router.core.pool import EndpointPool
from router.extproc.server import running_epp
from router.index.prefix_index import InMemoryPrefixIndex
from router.pool.discovery import Discovered, Found, KubernetesDiscovery, LivePool
from router.pool.scraper import EndpointMonitor, MonitorSettings
from router.serve.server import running_gateway
from router.upstream.client import UpstreamClient
from tests.gateways import gateway_config
from tests.router.extproc.envoy import MODEL, Envoy, chat_body, epp_config
from tests.router.pool.test_scraper import counting_replica

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
PODS = "/api/v1/namespaces/default/pods"


def pod(name: str, ip: str, ready: bool = True, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "vllm", **labels}},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def inference_pool(name: str, ports: list[int], **match: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": match or {"app": "vllm"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "prefixgate-epp", "port": {"number": 9002}},
        },
    }


def _matches(obj: dict[str, Any], label_selector: str, field_selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    wanted = dict(p.split("=", 1) for p in label_selector.split(",") if p)
    if field_selector:
        key, value = field_selector.split("=", 1)
        if key == "metadata.name" and obj["metadata"]["name"] != value:
            return False
    return all(labels.get(k) == v for k, v in wanted.items())


@dataclass
class Watcher:
    kind: str
    labels: str
    fields: str
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeKube:
    """Just enough of the API server: list and watch pods and InferencePools, 404, 410."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "pools": {}}
        self._rv = itertools.count(1)
        self.rv = 0
        self.compacted = 0
        self.watchers: list[Watcher] = []
        self.auth: list[str | None] = []
        self.lists = 0
        self.history: list[tuple[int, str, dict[str, Any]]] = []

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv = next(self._rv)
        obj = orjson.loads(orjson.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def _emit(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        self.history.append((self.rv, kind, {"type": event, "object": obj}))
        for w in self.watchers:
            if w.kind == kind and _matches(obj, w.labels, w.fields):
                w.queue.put_nowait({"type": event, "object": obj})

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        event = "MODIFIED" if name in self.objects[kind] else "ADDED"
        self.objects[kind][name] = obj = self._bump(obj)
        self._emit(kind, event, obj)

    def delete(self, kind: str, name: str) -> None:
        obj = self._bump(self.objects[kind].pop(name))
        self._emit(kind, "DELETED", obj)

    def expire_watches(self) -> None:
        """etcd compaction: open watches get a 410 and older versions are gone."""
        self.compacted = self.rv
        gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "gone"}}
        for w in self.watchers:
            w.queue.put_nowait(gone)
            w.queue.put_nowait(None)

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        q = request.query
        if q.get("watch") != "true":
            self.lists += 1
            items = [
                o
                for o in self.objects[kind].values()
                if _matches(o, q.get("labelSelector", ""), "")
            ]
            return web.json_response(
                {"items": items, "metadata": {"resourceVersion": str(self.rv)}}
            )
        selectors = (q.get("labelSelector", ""), q.get("fieldSelector", ""))
        watcher = Watcher(kind, *selectors)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if int(q.get("resourceVersion") or 0) < self.compacted:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
            await resp.write(orjson.dumps(gone) + b"\n")
            return resp
        since = int(q.get("resourceVersion") or 0)
        for rv, kind_, event in self.history:  # what happened since the client's version
            if rv > since and kind_ == kind and _matches(event["object"], *selectors):
                watcher.queue.put_nowait(event)
        self.watchers.append(watcher)
        try:
            async with asyncio.timeout(float(q.get("timeoutSeconds", "30"))):
                while (event := await watcher.queue.get()) is not None:
                    await resp.write(orjson.dumps(event) + b"\n")
        except TimeoutError:
            pass
        finally:
            self.watchers.remove(watcher)
        return resp

    async def _pool(self, request: web.Request) -> web.Response:
        found = self.objects["pools"].get(request.match_info["name"])
        if found is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(found)

    def app(self) -> web.Application:
        app = web.Application()

        async def pods(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, "pods")

        async def pools(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, "pools")

        app.router.add_get(PODS, pods)
        app.router.add_get(POOLS, pools)
        app.router.add_get(POOLS + "/{name}", self._pool)
        return app


@pytest.fixture
async def kube() -> AsyncIterator[tuple[FakeKube, str]]:
    fake = FakeKube()
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        for w in fake.watchers:
            w.queue.put_nowait(None)
        await runner.cleanup()


class Recorder:
    def __init__(self) -> None:
        self.latest: dict[str, Found] = {}
        self.calls = 0

    async def apply(self, endpoints: Discovered) -> None:
        self.latest = dict(endpoints)
        self.calls += 1

    def ready(self) -> dict[str, str]:
        return {eid: f.endpoint.role for eid, f in self.latest.items() if f.ready}


async def until(predicate: Callable[[], bool], seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 (changed by the watch task)
            await asyncio.sleep(0.01)


def discovery_config(url: str, **extra: Any) -> DiscoveryConfig:
    data = {"apiServer": url, "tokenFile": None, "namespace": "default", "retrySeconds": 0.05}
    return DiscoveryConfig.model_validate({**data, **extra})


@pytest.fixture
async def watch(
    kube: tuple[FakeKube, str],
) -> AsyncIterator[Callable[..., Any]]:
    started: list[KubernetesDiscovery] = []

    async def start(**extra: Any) -> tuple[KubernetesDiscovery, Recorder]:
        config = discovery_config(kube[1], **extra)
        recorder = Recorder()
        discovery = KubernetesDiscovery(config, recorder)
        started.append(discovery)
        await discovery.start()
        return discovery, recorder

    yield start
    for d in started:
        await d.stop()


async def test_pods_come_and_go_with_their_readiness_and_role(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    fake, _ = kube
    fake.put("pods", pod("a", "127.0.0.11"))
    fake.put("pods", pod("other", "127.0.0.99", app="other"))
    discovery, seen = await watch(labelSelector={"app": "vllm"}, targetPorts=[8000])
    assert discovery.synced
    assert seen.ready() == {"127.0.0.11:8000": "both"}
    fake.put("pods", pod("b", "127.0.0.12", ready=False, **{"llm-d.ai/role": "decode"}))
    await until(lambda: "127.0.0.12:8000" in seen.latest)
    assert seen.ready() == {"127.0.0.11:8000": "both"}
    fake.put("pods", pod("b", "127.0.0.12", **{"llm-d.ai/role": "decode"}))
    await until(lambda: "127.0.0.12:8000" in seen.ready())
    assert seen.ready()["127.0.0.12:8000"] == "decode"
    fake.delete("pods", "a")
    await until(lambda: "127.0.0.11:8000" not in seen.latest)
    assert seen.ready() == {"127.0.0.12:8000": "decode"}


async def test_an_expired_watch_lists_again(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    fake, _ = kube
    fake.put("pods", pod("a", "127.0.0.11"))
    _, seen = await watch(labelSelector={"app": "vllm"}, targetPorts=[8000])
    await until(lambda: bool(fake.watchers))
    lists = fake.lists
    fake.expire_watches()
    fake.delete("pods", "a")  # while no watch is open: only a new listing can tell
    fake.put("pods", pod("c", "127.0.0.13"))
    await until(lambda: seen.ready() == {"127.0.0.13:8000": "both"})
    assert fake.lists > lists


async def test_inference_pool_gives_selector_and_ports(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    fake, _ = kube
    fake.put("pools", inference_pool("llama", [8000, 8001]))
    fake.put("pods", pod("a", "127.0.0.11"))
    fake.put("pods", pod("x", "127.0.0.21", app="next"))
    _, seen = await watch(inferencePool="llama")
    assert set(seen.ready()) == {"127.0.0.11:8000", "127.0.0.11:8001"}
    # The pool moves to other pods and another port: the endpoints follow.
    fake.put("pools", inference_pool("llama", [9000], app="next"))
    await until(lambda: set(seen.ready()) == {"127.0.0.21:9000"})
    fake.delete("pools", "llama")
    await until(lambda: seen.latest == {})


async def test_missing_pool_is_retried_until_it_exists(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    fake, _ = kube
    fake.put("pods", pod("a", "127.0.0.11"))
    discovery, seen = await watch(inferencePool="late", initialSyncTimeoutSeconds=0.1)
    assert not discovery.synced
    fake.put("pools", inference_pool("late", [8000]))
    await until(lambda: discovery.synced and bool(seen.ready()))


async def test_service_account_token_is_sent(
    kube: tuple[FakeKube, str], watch: Callable[..., Any], tmp_path: Path
) -> None:
    fake, _ = kube
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    await watch(labelSelector={"app": "vllm"}, targetPorts=[8000], tokenFile=str(token))
    assert fake.auth and all(a == "Bearer s3cret" for a in fake.auth)


async def test_the_api_server_is_reached_over_tls_with_its_ca_bundle_and_token(
    certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    """As in a cluster: https, the service account's CA bundle, a bearer token."""
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    fake = FakeKube()
    fake.put("pods", pod("a", "127.0.0.7"))
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls).start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    seen = Recorder()
    config = discovery_config(
        url, labelSelector={"app": "vllm"}, targetPorts=[8000], caFile=str(cert),
        tokenFile=str(token),
    )
    discovery = KubernetesDiscovery(config, seen)
    try:
        await discovery.start()
        await until(lambda: seen.ready() == {"127.0.0.7:8000": "both"})
        fake.put("pods", pod("b", "127.0.0.8"))  # and the watch streams over the same TLS
        await until(lambda: "127.0.0.8:8000" in seen.ready())
        assert fake.auth and all(a == "Bearer t0ken" for a in fake.auth)
    finally:
        await discovery.stop()
        for w in fake.watchers:
            w.queue.put_nowait(None)
        await runner.cleanup()


async def test_an_untrusted_api_server_is_never_listed(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    fake = FakeKube()
    fake.put("pods", pod("a", "127.0.0.7"))
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls).start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    seen = Recorder()
    # No CA bundle: the system's CAs do not know the certificate.
    config = discovery_config(
        url, labelSelector={"app": "vllm"}, targetPorts=[8000], caFile=None,
        initialSyncTimeoutSeconds=0.2,
    )
    discovery = KubernetesDiscovery(config, seen)
    try:
        await discovery.start()
        assert not discovery.synced and fake.lists == 0 and seen.calls == 0
    finally:
        await discovery.stop()
        await runner.cleanup()


async def test_picker_follows_the_pods(kube: tuple[FakeKube, str], tmp_path: Path) -> None:
    """End to end: pods on two loopback addresses, the picker routes to what is there."""
    fake, url = kube
    sim = SimConfig(speed=20.0)
    async with start_replicas(1, sim, host="127.0.0.2") as first:
        port = first[0].port
        async with start_replicas(1, sim, host="127.0.0.3", base_port=port):
            fake.put("pods", pod("a", "127.0.0.2"))
            fake.put("pods", pod("b", "127.0.0.3"))
            discovery = {
                "labelSelector": {"app": "vllm"},
                "targetPorts": [port],
                "apiServer": url,
                "tokenFile": None,
                "namespace": "default",
            }
            config = epp_config([], discovery=discovery)
            async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as ch:
                envoy = Envoy(ch)
                a, b = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
                assert {s.endpoint.id for s in epp.gateway.pool if s.healthy} == {a, b}
                assert MODEL in epp.gateway.pool.models()
                call, routed = await envoy.send_request(chat_body("hello"))
                assert routed.header in (a, b)
                await envoy.finish(call)
                fake.delete("pods", "a")
                await until(lambda: {s.endpoint.id for s in epp.gateway.pool} == {b})
                for i in range(3):
                    call, routed = await envoy.send_request(chat_body(f"after {i}"))
                    assert routed.header == b
                    await envoy.finish(call)
                fake.put("pods", pod("b", "127.0.0.3", ready=False))
                await until(lambda: len(epp.gateway.pool) == 0)
                _, routed = await envoy.send_request(chat_body("nobody"))
                assert routed.immediate is not None and routed.immediate.status.code in (404, 503)


async def test_http_gateway_discovers_its_replicas(kube: tuple[FakeKube, str]) -> None:
    fake, url = kube
    async with start_replicas(1, SimConfig(speed=20.0)) as (replica,):
        fake.put("pods", pod("a", "127.0.0.1"))
        discovery = {
            "labelSelector": {"app": "vllm"},
            "targetPorts": [replica.port],
            "apiServer": url,
            "tokenFile": None,
        }
        async with (
            running_gateway(gateway_config([], discovery=discovery)) as gw,
            httpx.AsyncClient(base_url=gw.url) as client,
        ):
            resp = await client.post("/v1/chat/completions", content=chat_body("hi"))
            assert resp.status_code == 200
            assert resp.headers["x-gateway-destination-endpoint"] == f"127.0.0.1:{replica.port}"
            fake.delete("pods", "a")
            await until(lambda: len(gw.gateway.pool) == 0)


# -- review: watches that recover, restarts seen across a readiness blip ------------------------


async def test_a_pool_unchanged_since_compaction_is_still_watched(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    """An InferencePool last changed before etcd's compaction: its own resourceVersion is too
    old to watch from, the list's is not. Its watch stays open (no relist loop), and a change
    to it is followed."""
    fake, _ = kube
    fake.put("pools", inference_pool("llama", [8000]))
    fake.put("pods", pod("a", "127.0.0.11"))
    fake.put("pods", pod("b", "127.0.0.12"))
    fake.expire_watches()  # no watch open yet: only moves the oldest version kept
    _, seen = await watch(inferencePool="llama")
    assert set(seen.ready()) == {"127.0.0.11:8000", "127.0.0.12:8000"}
    await until(lambda: {w.kind for w in fake.watchers} == {"pods", "pools"}, 5.0)
    fake.put("pools", inference_pool("llama", [9000]))
    await until(lambda: set(seen.ready()) == {"127.0.0.11:9000", "127.0.0.12:9000"})


async def test_a_pool_watch_that_expires_checks_the_pool_again(
    kube: tuple[FakeKube, str], watch: Callable[..., Any]
) -> None:
    """A 410 on the InferencePool's watch is no error: the pool is read again and watched on."""
    fake, _ = kube
    fake.put("pools", inference_pool("llama", [8000]))
    fake.put("pods", pod("a", "127.0.0.11"))
    _, seen = await watch(inferencePool="llama")
    await until(lambda: {w.kind for w in fake.watchers} == {"pods", "pools"}, 5.0)
    fake.put("pools", {**inference_pool("llama", [8000]), "status": {"seen": True}})
    fake.expire_watches()
    await until(lambda: {w.kind for w in fake.watchers} == {"pods", "pools"}, 5.0)
    fake.put("pools", inference_pool("llama", [9000]))
    await until(lambda: set(seen.ready()) == {"127.0.0.11:9000"})


async def test_backoff_starts_over_after_the_watch_ran_well(
    kube: tuple[FakeKube, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The retry delay doubles while the API server keeps failing, and starts over once
    discovery has been working for a while: a blip an hour after the last one is retried
    at once, not after the longest delay."""
    fake, url = kube
    fake.put("pods", pod("a", "127.0.0.11"))
    failing = [2]
    serve = fake._serve

    async def flaky(request: web.Request, kind: str) -> web.StreamResponse:
        if request.query.get("watch") == "true" and failing[0]:
            failing[0] -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        return await serve(request, kind)

    fake._serve = flaky  # type: ignore[method-assign]
    now = [0.0]
    config = discovery_config(url, labelSelector={"app": "vllm"}, targetPorts=[8000])
    config = config.model_copy(update={"retry_seconds": 0.1})
    discovery = KubernetesDiscovery(config, Recorder(), clock=lambda: now[0])
    caplog.set_level("WARNING", logger="prefixgate.discovery")

    def delays() -> list[float]:
        return [float(r.args[1]) for r in caplog.records if "retrying" in r.msg]  # type: ignore[index,arg-type]

    try:
        await discovery.start()
        await until(lambda: len(delays()) == 2 and bool(fake.watchers))
        assert delays() == [0.1, 0.2]
        now[0] += 3600.0  # an hour of a working watch
        for w in fake.watchers:
            w.queue.put_nowait({"type": "ERROR", "object": {"code": 500, "message": "etcd"}})
        await until(lambda: len(delays()) == 3)
        assert delays()[2] == 0.1
    finally:
        await discovery.stop()


async def test_a_replica_restarted_while_not_ready_is_still_noticed() -> None:
    """In Kubernetes a container restart turns its pod NotReady until the new engine is up:
    the endpoint leaves the pool and comes back. The metrics scrape must still see its
    prefix-cache counter go back, so that the prefix index forgets what the old engine
    held (docs/reliability.md, replicas that restart)."""
    queries = [400.0]
    restarted: list[str] = []

    async def on_restart(endpoint_id: str, started: float) -> None:
        restarted.append(endpoint_id)

    client = UpstreamClient(8, 1.0)
    pool = EndpointPool()
    settings = MonitorSettings(scrape_interval=3600.0, health_interval=3600.0)
    monitor = EndpointMonitor(pool, client, settings, on_restart=on_restart)
    live = LivePool(pool, monitor)
    try:
        async with counting_replica(queries) as url:
            a = Endpoint.from_url(url)
            await live.apply({a.id: Found(a, True)})
            state = pool.get(a.id)
            assert state is not None
            await monitor._scrape(state)  # the engine has counted 400 queries
            await live.apply({a.id: Found(a, False)})  # its container restarts: the pod is NotReady
            queries[0] = 12.0  # a new engine
            await live.apply({a.id: Found(a, True)})
            state = pool.get(a.id)
            assert state is not None
            await monitor._scrape(state)
            assert restarted == [a.id]
            await live.apply({})  # the pod is deleted: nothing of it is kept
            assert a.id not in monitor._queries
    finally:
        await monitor.stop()
        await client.aclose()


async def test_a_new_pod_given_a_terminating_pods_ip_starts_afresh(
    kube: tuple[FakeKube, str],
) -> None:
    """Kubernetes may give the IP of a pod still terminating to a new pod: the same endpoint
    id, another replica, its cache empty. What the index held for the old pod is forgotten,
    and the pool's state of it (requests in flight, ejection, metrics) is not the new one's."""
    fake, url = kube
    pool = EndpointPool()
    index = InMemoryPrefixIndex()
    live = LivePool(pool, None, [index.forget_endpoint])
    config = discovery_config(url, labelSelector={"app": "vllm"}, targetPorts=[8000])
    discovery = KubernetesDiscovery(config, live)
    address = "127.0.0.11:8000"
    fake.put("pods", pod("old", "127.0.0.11"))
    await discovery.start()
    try:
        old = pool.get(address)
        assert old is not None
        index.record(address, [1, 2, 3])
        leaving = pod("old", "127.0.0.11", ready=False)
        leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        fake.put("pods", leaving)
        await until(lambda: pool.get(address) is None)
        assert index.match_now([1, 2, 3], [address]) == {address: 3}, "kept while not ready"
        fake.put("pods", pod("new", "127.0.0.11"))  # the old one is still terminating
        await until(lambda: pool.get(address) is not None)
        assert pool.get(address) is not old
        assert index.match_now([1, 2, 3], [address]) == {address: 0}
        fake.delete("pods", "old")  # gone at last: the new pod stays as it is
        index.record(address, [1, 2, 3])
        fake.put("pods", pod("other", "127.0.0.12"))
        await until(lambda: pool.get("127.0.0.12:8000") is not None)
        assert index.match_now([1, 2, 3], [address]) == {address: 3}
    finally:
        await discovery.stop()
