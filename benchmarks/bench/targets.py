"""What a benchmark compares: prefixgate strategies and peer routers, each in its own process.

A ``Target`` starts whatever serves the client (one gateway, two gateways sharing Redis or
nothing, or a peer router) in front of the replicas and returns the URLs the client sends to.
Everything binds to 127.0.0.1, metrics ports included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml

from benchmarks.bench.procs import HOST, Probe, Process, free_port, http_ok, wait_ready
from benchmarks.bench.settings import BenchSettings

READY_TIMEOUT_S = 60.0
REDIS_VARIANT = "default-redis-2gw"
# Named variants: a built-in strategy plus config sections laid over it.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "default-nofc": ("default", {"flowControl": {"enabled": False}}),
    "weighted-nofc": ("weighted", {"flowControl": {"enabled": False}}),
}
# "<built-in strategy>-2gw": that strategy on two gateways that share nothing.
SPLIT_SUFFIX = "-2gw"
# "<built-in strategy>-2w": that strategy on one gateway of two worker processes (--workers 2).
WORKERS_SUFFIX = "-2w"


class Unavailable(Exception):
    """The target cannot run here; the report says why and goes on."""


class Target(Protocol):
    name: str
    kind: str

    def unavailable(self) -> str | None:
        """Why this target cannot run here, or None."""

    async def start(
        self, replicas: Sequence[str], stack: contextlib.AsyncExitStack
    ) -> list[str]:
        """Start it in front of ``replicas`` (stopped when ``stack`` closes); client URLs."""


async def _spawn(
    stack: contextlib.AsyncExitStack, name: str, args: Sequence[str], settings: BenchSettings
) -> Process:
    proc = Process(name, args, settings.out / "logs" / f"{name}.log")
    stack.push_async_callback(proc.stop)
    return proc


def _ready_all(url: str, n: int) -> Probe:
    """prefixgate's /ready once every replica passed its health check."""

    async def probe(http: aiohttp.ClientSession) -> bool:
        async with http.get(f"{url}/ready") as resp:
            body = await resp.json(content_type=None)
            return resp.status == 200 and int(body.get("healthy_endpoints", 0)) >= n

    return probe


def _workers_ready(url: str, n: int, workers: int) -> Probe:
    """Every worker of a ``--workers`` gateway up, each with every replica healthy (a scrape
    answers for all workers: router/serve/worker_metrics.py)."""

    async def probe(http: aiohttp.ClientSession) -> bool:
        from prometheus_client.parser import text_string_to_metric_families

        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        up: dict[str, float] = {}
        healthy: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                into = {"prefixgate_worker_up": up, "prefixgate_endpoint_healthy": healthy}
                if s.name in into:
                    worker = s.labels["worker"]
                    into[s.name][worker] = into[s.name].get(worker, 0.0) + s.value
        return sum(up.values()) == workers and sorted(healthy.values()) == [n] * workers

    return probe


def _gateway_args(
    port: int, config: Path | None, backends: Sequence[str], strategy: str, log_level: str
) -> list[str]:
    args = [sys.executable, "-m", "router.cli", "serve", "--host", HOST, "--port", str(port)]
    if config is not None:
        args += ["--config", str(config)]
    else:
        for url in backends:
            args += ["--backend", url]
        args += ["--strategy", strategy]
    return [*args, "--log-level", log_level]


@dataclass
class Strategy:
    """A built-in strategy on ``gateways`` gateway processes, or a user's YAML config whose
    pool is replaced by the benchmark's replicas. Several gateways share nothing (each keeps
    its own index, affinity and queue view; the client alternates requests between them, as
    an L4 balancer in front would): what a fleet without the shared Redis index sees."""

    name: str
    settings: BenchSettings
    config: Path | None = None
    kind: str = "prefixgate"
    strategy: str = ""  # the built-in strategy; the name when empty
    gateways: int = 1
    prefix_index: dict[str, Any] | None = None  # the config's prefixIndex section
    overlay: dict[str, Any] | None = None  # further top-level sections (a variant's)
    workers: int = 1  # server.workers of each gateway

    def unavailable(self) -> str | None:
        return None

    @property
    def builtin(self) -> str:
        return self.strategy or self.name

    @property
    def needs_kv_events(self) -> bool:
        """Routes on the replicas' KV events: a built-in precise strategy, or a config with
        a ``precisePrefix`` section."""
        if self.config is None:
            return self.builtin.startswith("precise")
        data = yaml.safe_load(self.config.read_text()) or {}
        return isinstance(data, dict) and "precisePrefix" in data

    def _precise(self, data: dict[str, Any]) -> None:
        s = self.settings
        precise = data.setdefault("precisePrefix", {})
        precise.setdefault("blockSize", s.block_size)
        precise.setdefault("tokenizer", {"type": "sim"})
        events = precise.setdefault("kvEvents", {})
        events.setdefault("portOffset", s.kv_events_offset)
        events.setdefault("replayPortOffset", s.kv_replay_offset)

    def _config_file(self, replicas: Sequence[str], port: int, process: str) -> Path | None:
        plain = self.prefix_index is None and self.overlay is None and self.workers == 1
        if self.config is None and not self.needs_kv_events and plain:
            return None
        data: dict[str, Any] = {"strategy": self.builtin}
        if self.config is not None:
            data = yaml.safe_load(self.config.read_text()) or {}
        if self.needs_kv_events:
            self._precise(data)
        if self.prefix_index is not None:
            data["prefixIndex"] = self.prefix_index
        data.update(self.overlay or {})
        data.setdefault("pool", {})["endpoints"] = [{"url": u} for u in replicas]
        data.setdefault("server", {}).update(host=HOST, port=port)
        if self.workers > 1:
            data["server"]["workers"] = self.workers
        path = self.settings.out / "logs" / f"{process}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    async def start(self, replicas: Sequence[str], stack: contextlib.AsyncExitStack) -> list[str]:
        urls, procs = [], []
        for i in range(self.gateways):
            process = self.name if self.gateways == 1 else f"{self.name}-{i}"
            port = free_port()
            args = _gateway_args(
                port, self._config_file(replicas, port, process), replicas, self.builtin,
                self.settings.gateway_log_level,
            )
            procs.append(await _spawn(stack, process, args, self.settings))
            urls.append(f"http://{HOST}:{port}")
        probes = [_ready_all(u, len(replicas)) for u in urls]
        if self.workers > 1:
            probes = [_workers_ready(u, len(replicas), self.workers) for u in urls]
        await wait_ready(procs, probes, READY_TIMEOUT_S)
        return urls


@dataclass
class RedisGateways(Strategy):
    """The default profile on two gateway replicas sharing the Redis prefix index; the client
    alternates requests between them (an L4 balancer in front)."""

    def unavailable(self) -> str | None:
        if self.settings.redis_url or shutil.which("redis-server"):
            return None
        return "no --redis-url / REDIS_URL and no redis-server binary"

    async def _redis(self, stack: contextlib.AsyncExitStack) -> str:
        if self.settings.redis_url:
            return self.settings.redis_url
        port = free_port()
        binary = shutil.which("redis-server") or "redis-server"
        args = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        proc = await _spawn(stack, "redis", args, self.settings)
        url = f"redis://{HOST}:{port}/0"
        await wait_ready([proc], [_redis_ping(url)], 10.0)
        return url

    async def start(self, replicas: Sequence[str], stack: contextlib.AsyncExitStack) -> list[str]:
        redis_url = await self._redis(stack)
        namespace = "bench" + uuid.uuid4().hex[:12]  # fresh keys: no index left from a last run
        self.prefix_index = {"backend": "redis", "url": redis_url, "namespace": namespace}
        urls = await super().start(replicas, stack)
        await _require_redis_wired(urls[0])
        return urls


def _redis_ping(url: str) -> Probe:
    async def probe(http: aiohttp.ClientSession) -> bool:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(url, socket_timeout=0.5)
        try:
            return bool(await client.ping())
        except (redis.asyncio.RedisError, OSError):
            return False  # not listening yet
        finally:
            await client.aclose()

    return probe


async def _require_redis_wired(url: str) -> None:
    # The config accepts backend: redis before the gateway uses it; its Redis metrics tell.
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    if "prefixgate_redis" not in text and "prefixgate_index_lookups" not in text:
        raise Unavailable(
            "the gateway accepted prefixIndex.backend=redis but exposes no Redis metrics: "
            "the Redis backend is not wired into this build yet"
        )


# -- peers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerSpec:
    router: str  # venv folder name under a peers dir
    binary: str
    env_var: str
    policy: str


PEERS: dict[str, PeerSpec] = {
    "vllm-router-cache_aware": PeerSpec(
        "vllm-router", "vllm-router", "PREFIXGATE_VLLM_ROUTER", "cache_aware"
    ),
    "vllm-router-round_robin": PeerSpec(
        "vllm-router", "vllm-router", "PREFIXGATE_VLLM_ROUTER", "round_robin"
    ),
    "smg-cache_aware": PeerSpec("smg", "smg", "PREFIXGATE_SMG", "cache_aware"),
}


def peer_dirs(explicit: Sequence[Path] = ()) -> list[Path]:
    """Where peer venvs are looked for: flags, then $PREFIXGATE_PEERS_DIR, then the cache."""
    dirs = list(explicit)
    env = os.environ.get("PREFIXGATE_PEERS_DIR")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(Path.home() / ".cache" / "prefixgate-peers")
    return dirs


def find_peer_binary(spec: PeerSpec, dirs: Sequence[Path]) -> Path | None:
    override = os.environ.get(spec.env_var)
    if override:
        return Path(override) if Path(override).is_file() else None
    for base in dirs:
        candidate = base / spec.router / "bin" / spec.binary
        if candidate.is_file():
            return candidate
    return None


def peer_args(
    spec: PeerSpec, binary: Path, port: int, metrics_port: int, replicas: Sequence[str]
) -> list[str]:
    """The command line of a peer router in front of ``replicas``, all bound to loopback."""
    common = ["--host", HOST, "--port", str(port), "--worker-urls", *replicas,
              "--policy", spec.policy, "--prometheus-host", HOST,
              "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1"]
    if spec.router == "smg":
        return [str(binary), "launch", *common, "--backend", "vllm", "--log-level", "warn"]
    return [str(binary), *common, "--log-level", "warning"]


@dataclass
class Peer:
    name: str
    spec: PeerSpec
    settings: BenchSettings
    kind: str = "peer"

    @property
    def binary(self) -> Path | None:
        return find_peer_binary(self.spec, self.settings.peer_dirs)

    def unavailable(self) -> str | None:
        if self.binary is None:
            dirs = ", ".join(str(d) for d in self.settings.peer_dirs)
            return (
                f"{self.spec.router} not installed (looked in {dirs}; or set {self.spec.env_var})"
            )
        return None

    def args(
        self, binary: Path, port: int, metrics_port: int, replicas: Sequence[str]
    ) -> list[str]:
        return peer_args(self.spec, binary, port, metrics_port, replicas)

    async def start(self, replicas: Sequence[str], stack: contextlib.AsyncExitStack) -> list[str]:
        binary = self.binary
        if binary is None:
            raise Unavailable(self.unavailable() or "not installed")
        port, metrics_port = free_port(), free_port()
        args = self.args(binary, port, metrics_port, replicas)
        proc = await _spawn(stack, self.name, args, self.settings)
        url = f"http://{HOST}:{port}"
        await wait_ready([proc], [http_ok(f"{url}/v1/models"), http_ok(f"{url}/health")],
                         READY_TIMEOUT_S)
        return [url]


def make_targets(
    strategies: Sequence[str], peers: Sequence[str], settings: BenchSettings
) -> list[Target]:
    """Targets for names: built-in strategies, each also as ``<strategy>-2gw`` (two gateways
    sharing nothing), ``<strategy>-2w`` (one gateway, two workers), ``VARIANTS``
    (``default-nofc``: flow control off), ``default-redis-2gw``, ``label=config.yaml``, and
    peer names (``PEERS``). Unknown names fail before anything starts."""
    from router.config.strategies import STRATEGIES

    out: list[Target] = []
    for name in strategies:
        if "=" in name:
            label, path = name.split("=", 1)
            if not Path(path).is_file():
                raise ValueError(f"strategy {label}: no config file {path}")
            out.append(Strategy(label, settings, Path(path)))
        elif name == REDIS_VARIANT:
            out.append(RedisGateways(name, settings, strategy="default", gateways=2))
        elif name in VARIANTS:
            base, overlay = VARIANTS[name]
            out.append(Strategy(name, settings, strategy=base, overlay=overlay))
        elif name in STRATEGIES:
            out.append(Strategy(name, settings))
        elif name.endswith(SPLIT_SUFFIX) and name.removesuffix(SPLIT_SUFFIX) in STRATEGIES:
            base = name.removesuffix(SPLIT_SUFFIX)
            out.append(Strategy(name, settings, strategy=base, gateways=2))
        elif name.endswith(WORKERS_SUFFIX) and name.removesuffix(WORKERS_SUFFIX) in STRATEGIES:
            base = name.removesuffix(WORKERS_SUFFIX)
            out.append(Strategy(name, settings, strategy=base, workers=2))
        else:
            suffixed = [f"<strategy>{SPLIT_SUFFIX}", f"<strategy>{WORKERS_SUFFIX}"]
            known = ", ".join([*STRATEGIES, *VARIANTS, REDIS_VARIANT, *suffixed])
            raise ValueError(f"unknown strategy {name!r} (known: {known}, or label=config.yaml)")
    for name in peers:
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
        out.append(Peer(name, PEERS[name], settings))
    return out
