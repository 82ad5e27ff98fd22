"""Endpoints from Kubernetes: the pods of an ``InferencePool`` or of a plain label selector.

Talks to the API server with the gateway's own HTTP client (router/upstream; TLS with the
service account's CA bundle and bearer token): list, then watch from the list's
resourceVersion, relist when the watch expires, the way client-go's informers do, without a
client library: the surface needed is three GETs. Each pod IP x target port is one endpoint
(``ip:port``, as GIE names them); its role comes from the ``llm-d.ai/role`` label and its
readiness from the pod's ``Ready`` condition. Changes reach the running gateway through an
:class:`EndpointSink`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from router.config.model import DiscoveryConfig
from router.core.endpoints import Endpoint, Role
from router.core.pool import EndpointPool
from router.core.tasks import cancel_and_wait
from router.pool.kube_api import (
    REQUEST_SECONDS,
    KubeApi,
    PoolMissing,
    WatchExpired,
    api_settings,
)
from router.pool.scraper import EndpointMonitor
from router.upstream.client import UpstreamClient

log = logging.getLogger("prefixgate.discovery")

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
MAX_BACKOFF_SECONDS = 30.0
# A pass that ran this long was working: its failure starts the backoff over (client-go's
# reflector resets its backoff after 2 minutes the same way).
BACKOFF_RESET_SECONDS = 120.0
_ROLES: dict[str, Role] = {
    "prefill": "prefill",
    "decode": "decode",
    "prefill-decode": "both",
    "both": "both",
}


class Found(NamedTuple):
    """An endpoint as discovery sees it: ready or not, and the pod serving it (its uid). A new
    pod can get the IP, and so the endpoint id, of one still terminating: another replica,
    whose cache is empty."""

    endpoint: Endpoint
    ready: bool
    pod: str = ""


# Endpoint id -> what is found there.
Discovered = Mapping[str, Found]


class EndpointSink(Protocol):
    """Where discovery sends the complete set of endpoints it currently sees."""

    async def apply(self, endpoints: Discovered) -> None: ...


def role_of(labels: Mapping[str, str], key: str) -> Role:
    value = labels.get(key)
    if value is None:
        return "both"
    role = _ROLES.get(value)
    if role is None:
        log.warning("unknown %s=%r: treated as prefill-decode", key, value)
        return "both"
    return role


def _leaving(pod: Mapping[str, Any]) -> bool:
    """Being deleted, or done for good (an evicted pod stays listed, its IP given away)."""
    status = pod.get("status") or {}
    deleted = (pod.get("metadata") or {}).get("deletionTimestamp")
    return bool(deleted) or status.get("phase") in ("Failed", "Succeeded")


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_endpoints(
    pod: Mapping[str, Any], ports: Sequence[int], config: DiscoveryConfig
) -> list[Found]:
    """One endpoint per target port of a pod that has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return []
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    role = role_of(labels, config.role_label)
    host = f"[{ip}]" if ":" in ip else ip
    ready = _ready(pod)
    # Its uid: a pod deleted and created again under the same name is another one too.
    identity = str(metadata.get("uid") or metadata.get("name") or "")
    urls = (f"{config.scheme}://{host}:{port}" for port in ports)
    return [Found(Endpoint.from_url(url, role, config.models), ready, identity) for url in urls]


def selector_string(match_labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def pool_spec(pool: Mapping[str, Any]) -> tuple[str, list[int]]:
    """(label selector, target ports) of an ``inference.networking.k8s.io/v1`` InferencePool."""
    spec = pool.get("spec") or {}
    match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if "number" in p]
    if not ports:
        raise ValueError("InferencePool has no spec.targetPorts")
    return selector_string(match_labels), ports


def _resource_version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def apply_event(objects: dict[str, dict[str, Any]], event: Mapping[str, Any]) -> str:
    """Fold one watch event into ``objects`` (by name); returns the new resourceVersion."""
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise WatchExpired(str(obj.get("message", "")))
        raise RuntimeError(f"watch error: {obj.get('message', obj)}")
    name = str((obj.get("metadata") or {}).get("name", ""))
    if kind in ("ADDED", "MODIFIED"):
        objects[name] = dict(obj)
    elif kind == "DELETED":
        objects.pop(name, None)
    return _resource_version(obj)


class KubernetesDiscovery:
    """Keeps an :class:`EndpointSink` in step with the pods Kubernetes reports."""

    def __init__(
        self,
        config: DiscoveryConfig,
        sink: EndpointSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._sink = sink
        self._clock = clock
        self._client: UpstreamClient | None = None
        self._api: KubeApi | None = None
        self._namespace = config.namespace or "default"
        self._published: dict[str, Found] | None = None
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def synced(self) -> bool:
        """True once the pods were listed (the picker is ready to answer)."""
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    async def start(self) -> None:
        """Open the API client, start watching; wait (bounded) for the first listing so
        start-up sees endpoints."""
        server, tls, self._namespace = await asyncio.to_thread(api_settings, self._config)
        # Its own connections: the watches hold theirs for minutes.
        self._client = UpstreamClient(8, REQUEST_SECONDS, ssl_context=tls)
        self._api = KubeApi(self._client, server, self._config.token_file)
        self._task = asyncio.create_task(self._run(), name="k8s-discovery")
        try:
            async with asyncio.timeout(self._config.initial_sync_timeout_seconds):
                await self._synced.wait()
        except TimeoutError:
            log.warning("discovery: no pod listing yet; serving while it keeps trying")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def api(self) -> KubeApi:
        assert self._api is not None, "discovery was not started"
        return self._api

    async def _run(self) -> None:
        backoff = self._config.retry_seconds
        while True:
            started = self._clock()
            try:
                await self._cycle()
                backoff = self._config.retry_seconds
            except asyncio.CancelledError:
                raise
            except PoolMissing:
                log.warning("discovery: InferencePool %r not found", self._config.inference_pool)
                await self._publish({})
            except Exception as exc:  # the API server may be briefly away: keep what we have
                if self._clock() - started >= BACKOFF_RESET_SECONDS:
                    backoff = self._config.retry_seconds  # a new failure, not the same one
                log.warning("discovery: %s; retrying in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)

    async def _cycle(self) -> None:
        """One pass: returns when the pool's spec changed or it went away; raises on errors."""
        cfg = self._config
        if cfg.label_selector is not None:
            await self._pods(selector_string(cfg.label_selector), cfg.target_ports)
            return
        path = f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{self._namespace}/inferencepools"
        spec, rv = await self._pool(path)
        pods = asyncio.create_task(self._pods(*spec))
        watch = asyncio.create_task(self._pool_changed(path, rv, spec))
        try:
            done, _ = await asyncio.wait({pods, watch}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (pods, watch):
                task.cancel()
            await asyncio.gather(pods, watch, return_exceptions=True)

    async def _pool(self, path: str) -> tuple[tuple[str, list[int]], str]:
        """The InferencePool's (selector, ports), and the resourceVersion to watch it from:
        its list's (the pool's own is as old as its last change, likely older than etcd
        keeps, and a watch from it would be 410 Gone at once)."""
        name = str(self._config.inference_pool)
        listing = await self.api.get(path, {"fieldSelector": f"metadata.name={name}"})
        for item in listing.get("items") or []:
            if (item.get("metadata") or {}).get("name") == name:
                return pool_spec(item), _resource_version(listing)
        raise PoolMissing(f"{path}/{name}")

    async def _pool_changed(self, path: str, rv: str, spec: tuple[str, list[int]]) -> None:
        """Return when the InferencePool's selector or ports change, or it is deleted."""
        params = {"fieldSelector": f"metadata.name={self._config.inference_pool}"}
        pools: dict[str, dict[str, Any]] = {}
        while True:
            stream = self.api.watch(
                path, {**params, "resourceVersion": rv}, self._config.watch_timeout_seconds
            )
            try:
                async for event in stream:
                    rv = apply_event(pools, event) or rv
                    if event.get("type") == "DELETED":
                        return
                    current = pools.get(str(self._config.inference_pool))
                    if current is not None and pool_spec(current) != spec:
                        log.info("discovery: InferencePool changed: %s", pool_spec(current))
                        return
            except WatchExpired:  # read it again (PoolMissing if it went meanwhile)
                latest, rv = await self._pool(path)
                if latest != spec:
                    log.info("discovery: InferencePool changed: %s", latest)
                    return

    async def _pods(self, selector: str, ports: list[int]) -> None:
        """List the pods, then follow their changes; relist when the watch expires."""
        path = f"/api/v1/namespaces/{self._namespace}/pods"
        params = {"labelSelector": selector}
        while True:
            listing = await self.api.get(path, params)
            pods = {
                str(p.get("metadata", {}).get("name", "")): p for p in listing.get("items") or []
            }
            rv = _resource_version(listing)
            await self._publish(self._endpoints(pods, ports))
            self._synced.set()
            try:
                while True:
                    stream = self.api.watch(
                        path, {**params, "resourceVersion": rv}, self._config.watch_timeout_seconds
                    )
                    async for event in stream:
                        rv = apply_event(pods, event) or rv
                        if event.get("type") != "BOOKMARK":
                            await self._publish(self._endpoints(pods, ports))
            except WatchExpired:
                log.info("discovery: watch expired, listing pods again")

    def _endpoints(
        self, pods: Mapping[str, Mapping[str, Any]], ports: Sequence[int]
    ) -> dict[str, Found]:
        found: dict[str, Found] = {}
        ranks: dict[str, tuple[bool, bool]] = {}
        for pod in pods.values():
            leaving = _leaving(pod)
            for seen in pod_endpoints(pod, ports, self._config):
                # Two pods can share an IP (one terminating or evicted, one given its IP):
                # the ready one wins, else the one not on its way out.
                rank = (seen.ready, not leaving)
                eid = seen.endpoint.id
                if eid not in found or rank > ranks[eid]:
                    found[eid], ranks[eid] = seen, rank
        return found

    async def _publish(self, endpoints: dict[str, Found]) -> None:
        if endpoints == self._published:
            return
        self._published = endpoints
        ready = sum(1 for f in endpoints.values() if f.ready)
        log.info("discovery: %d endpoints, %d ready", len(endpoints), ready)
        await self._sink.apply(endpoints)


Forget = Callable[[str], Awaitable[None]]
Join = Callable[[Endpoint], None]


class LivePool:
    """The sink of a running gateway: pool membership, health polling, index and affinity.

    A pod that turns unready leaves the pool but keeps its prefix-index entries (its cache
    survives a readiness blip); one that disappears, or whose address another pod now has,
    is forgotten everywhere (a pod at the same address starts afresh). ``joined`` hears
    of each endpoint discovery starts managing, ready or not (KV event subscribers follow a
    pod from its creation, so its cache is known once it turns ready). Endpoints from the
    static config are never touched.
    """

    def __init__(
        self,
        pool: EndpointPool,
        monitor: EndpointMonitor | None = None,
        forget: Sequence[Forget] = (),
        joined: Sequence[Join] = (),
    ) -> None:
        self._pool = pool
        self._monitor = monitor
        self._forget = list(forget)
        self._joined = list(joined)
        self._managed: dict[str, Found] = {}

    def _leave(self, endpoint_id: str, keep: bool = False) -> None:
        self._pool.remove(endpoint_id, keep)
        if self._monitor is not None:
            # Not ready only: its last scrape stays, to tell a restart when it is back.
            self._monitor.unwatch(endpoint_id, forget=not keep)

    async def apply(self, endpoints: Discovered) -> None:
        for endpoint_id, known in list(self._managed.items()):
            current = endpoints.get(endpoint_id)
            # Another pod at the address (a terminating pod's IP given to a new one): what was
            # learned there, its prefixes above all, was the old pod's.
            gone = current is None or current.pod != known.pod
            if gone or current is None or current.endpoint != known.endpoint:
                self._leave(endpoint_id)
                del self._managed[endpoint_id]
            if gone:
                for forget in self._forget:
                    await forget(endpoint_id)
        added = False
        for endpoint_id, found in endpoints.items():
            endpoint, ready = found.endpoint, found.ready
            present = self._pool.get(endpoint_id) is not None
            if endpoint_id not in self._managed and present:
                continue  # a static endpoint of the config
            if endpoint_id not in self._managed:
                for join in self._joined:
                    join(endpoint)
            self._managed[endpoint_id] = found
            if ready and not present:
                state = self._pool.add(endpoint)
                state.healthy = True  # the kubelet's readiness probe just passed
                if self._monitor is not None:
                    self._monitor.watch(state)
                added = True
            elif not ready and present:
                self._leave(endpoint_id, keep=True)  # still there: back soon, most likely
        if added and self._monitor is not None:
            # Learns the new endpoints' models (/v1/models) now instead of a health tick later.
            await self._monitor.check_all()
