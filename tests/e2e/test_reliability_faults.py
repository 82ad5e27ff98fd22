"""Fault tests under steady load (shortened for CI; loopback only, every wait bounded).

A replica killed with SIGKILL and restarted, a slow replica, and a storm of 200 clients that
leave mid-stream or while still queued. What counts: the requests that failed (only those in
flight on the killed replica, each ended with an SSE error event), hung ones (none), and where
new requests go (not to the dead replica once it is out, which must be within one health
interval; to it again once it is back).

``FAULT_TEST_SECONDS=N`` runs the full versions: N seconds of load before, during and after
each fault, with 32 clients instead of 8 (docs/benchmarks/reliability.md has N=30's figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import EndpointState
from router.serve.server import RunningGateway, bind_socket, running_gateway
from tests.gateways import MODEL, gateway_config

pytestmark = pytest.mark.slow

# The victim must be out within one health interval: the failed streams and the fast metrics
# scrape (every 0.05 s, two failures) take it out in ~0.1 s, health checks alone in one to two
# intervals. 2 s keeps that bound 20x above the fast path, which a loaded machine's loop lag
# can stretch past 0.5 s, while a gateway that waited for health checks still fails it.
HEALTH_INTERVAL = 2.0
# Bounds on waits for something that must happen ("eventually"), not measurements: generous,
# as they cost nothing when it happens and only a loaded machine comes near them.
EVENTUALLY = 30.0
# A request still open after this long hung. One of 1,000 tokens takes ~1 s here, but 10 s (the
# old bound) ran out for two of them in a full-suite run under a CPU hog, with 8 streams
# relayed token by token on the test's one loop; a stream the gateway never ends still fails.
HUNG_AFTER = 60.0
PHASE = float(os.environ.get("FAULT_TEST_SECONDS", "0"))  # 0: CI's shortened runs
WORKERS = 32 if PHASE else 8
SPEED = 20.0
DEST = "x-gateway-destination-endpoint"


@dataclass
class Outcome:
    started: float
    endpoint: str | None = None
    status: int | None = None
    done: bool = False
    error_event: bool = False
    hung: bool = False
    exception: str | None = None

    @property
    def failed(self) -> bool:
        return not (self.status == 200 and self.done)


def free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port: int = sock.getsockname()[1]
    sock.close()
    return port


async def _wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


@contextlib.asynccontextmanager
async def sim_process(port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """One simulated replica in its own process, so that it can really be SIGKILLed."""
    args = ["-m", "benchmarks.sim", "--port", str(port), "--speed", str(SPEED),
            "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        break
                assert proc.returncode is None, "the simulator exited"
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the simulator did not start")
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        async with asyncio.timeout(10):
            await proc.wait()


async def one_request(
    http: httpx.AsyncClient, i: int, max_tokens: int = 60, out: Outcome | None = None
) -> Outcome:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {i % 8}: " + "words " * 40}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    out = out or Outcome(time.monotonic())
    try:
        async with asyncio.timeout(HUNG_AFTER):
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                out.endpoint, out.status = resp.headers.get(DEST), resp.status_code
                text = b"".join([chunk async for chunk in resp.aiter_bytes()])
        out.done = text.rstrip().endswith(b"data: [DONE]")
        out.error_event = b'\n\ndata: {"error"' in text or text.startswith(b'data: {"error"')
    except TimeoutError:
        out.hung = True
    except httpx.HTTPError as exc:
        out.exception = repr(exc)
    return out


class SteadyLoad:
    """``workers`` clients sending streaming requests back to back until stopped."""

    def __init__(self, url: str, workers: int = 8, max_tokens: int = 60) -> None:
        self.outcomes: list[Outcome] = []
        self.running: set[int] = set()  # ids of the outcomes still streaming
        self._url = url
        self._workers = workers
        self._max_tokens = max_tokens
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http = httpx.AsyncClient(base_url=url, timeout=15)

    async def __aenter__(self) -> SteadyLoad:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self._workers)]
        return self

    async def _worker(self, n: int) -> None:
        i = n
        while not self._stop.is_set():
            out = Outcome(time.monotonic())
            self.outcomes.append(out)
            self.running.add(id(out))
            await one_request(self._http, i, self._max_tokens, out)
            self.running.discard(id(out))
            i += self._workers

    def streaming_from(self, endpoint: str) -> bool:
        """Some request is mid-stream from ``endpoint`` (its response has started)."""
        return any(o.endpoint == endpoint for o in self.outcomes if id(o) in self.running)

    async def stop(self) -> None:
        self._stop.set()
        async with asyncio.timeout(HUNG_AFTER + 10):
            await asyncio.gather(*self._tasks)
        await self._http.aclose()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def fault_config(urls: list[str]) -> object:
    return gateway_config(
        urls,
        pool={
            "endpoints": [{"url": u} for u in urls],
            "healthCheck": {"intervalSeconds": HEALTH_INTERVAL, "unhealthyThreshold": 2},
            "metricsScrape": {"intervalSeconds": 0.05},
            "outlierDetection": {"consecutiveFailures": 3, "baseEjectionSeconds": 0.5},
        },
    )


def _attempts_on(gw: RunningGateway, endpoint: str) -> float:
    registry = gw.gateway.metrics.registry
    return sum(
        registry.get_sample_value(
            "prefixgate_upstream_failures_total", {"endpoint": endpoint, "kind": kind}
        ) or 0.0
        for kind in ("transport", "timeout", "5xx")
    )


def _answered(load: SteadyLoad) -> int:
    return sum(1 for o in load.outcomes if o.status == 200 and o.done)


def _all_settled(gw: RunningGateway) -> bool:
    return all(
        s.in_flight == 0 and s.pending_prefill_tokens == 0 and s.pending_prefill_requests == 0
        for s in gw.gateway.pool
    )


def _pool_view(gw: RunningGateway) -> str:
    """What routing saw of each endpoint, for a failure's message."""
    registry = gw.gateway.metrics.registry

    def learned(name: str, endpoint: str) -> float | None:
        metric = f"prefixgate_calibrated_prefill_{name}"
        return registry.get_sample_value(metric, {"endpoint": endpoint})

    return "; ".join(
        f"{s.endpoint.id} eligible={s.eligible} in_flight={s.in_flight} "
        f"pending={s.pending_prefill_tokens}/{s.pending_prefill_requests} "
        f"running={s.metrics.running} waiting={s.metrics.waiting} "
        f"overhead={learned('overhead_seconds', s.endpoint.id)} "
        f"per_token={learned('seconds_per_token', s.endpoint.id)}"
        for s in gw.gateway.pool
    )


async def _watch_leaving(state: EndpointState, since: float) -> float:
    """Seconds from ``since`` until the endpoint is no longer a candidate."""
    while state.eligible:  # noqa: ASYNC110 (changed by the gateway's tasks)
        await asyncio.sleep(0.005)
    return time.monotonic() - since


async def test_killed_replica_fails_only_its_in_flight_streams() -> None:
    port = free_port()
    victim = f"127.0.0.1:{port}"
    async with start_replicas(3, SimConfig(speed=SPEED)) as others:
        urls = [r.url for r in others] + [f"http://{victim}"]
        async with sim_process(port) as proc, running_gateway(fault_config(urls)) as gw:
            state = gw.gateway.pool.get(victim)
            assert state is not None and state.eligible
            async with SteadyLoad(gw.url, WORKERS, max_tokens=1000) as load:
                await asyncio.sleep(PHASE)
                assert await _wait_for(lambda: load.streaming_from(victim), EVENTUALLY)
                in_flight_at_kill = state.in_flight
                killed_at = time.monotonic()
                proc.kill()
                left_after = await asyncio.wait_for(_watch_leaving(state, killed_at), EVENTUALLY)
                await asyncio.sleep(HEALTH_INTERVAL)
                tries_while_out = _attempts_on(gw, victim)
                await asyncio.sleep(max(HEALTH_INTERVAL, PHASE))
                assert _attempts_on(gw, victim) == tries_while_out, "no attempts while out"
                async with sim_process(port):
                    restarted_at = time.monotonic()
                    assert await _wait_for(lambda: state.eligible, EVENTUALLY), "back after restart"
                    assert await _wait_for(
                        lambda: any(
                            o.endpoint == victim and o.started > restarted_at
                            for o in load.outcomes
                        ),
                        EVENTUALLY,
                    ), f"new requests reach the restarted replica: {_pool_view(gw)}"
                    await asyncio.sleep(PHASE)
                    # Enough answers beside the failed ones, counted rather than timed: a
                    # loaded machine finishes fewer requests in the same phases.
                    assert await _wait_for(lambda: _answered(load) > 10, EVENTUALLY)
                    await load.stop()  # before the replica goes away again
                    # Every lease was released, failed streams and retries included.
                    assert await _wait_for(lambda: _all_settled(gw), EVENTUALLY), _pool_view(gw)
            retries = gw.gateway.metrics.registry.get_sample_value("prefixgate_retries_total")
    outcomes = load.outcomes
    failed = [o for o in outcomes if o.failed]
    assert not [o for o in outcomes if o.hung], "no request hung"
    assert not [o for o in outcomes if o.exception], "every request got an HTTP answer"
    assert left_after <= HEALTH_INTERVAL, f"took {left_after:.2f}s to stop sending to it"
    # Only streams already running on the killed replica failed, each with an error event.
    assert 1 <= len(failed) <= in_flight_at_kill
    for o in failed:
        assert o.endpoint == victim and o.started < killed_at and o.error_event, o
    assert len(outcomes) - len(failed) > 10
    assert any(o.endpoint == victim and o.started > restarted_at for o in outcomes)
    print(
        f"\nkill/restart: sent {len(outcomes)}, failed {len(failed)} "
        f"(in flight on the victim at the kill: {in_flight_at_kill}), hung 0, "
        f"retried {retries:.0f}, out after {left_after * 1000:.0f} ms"
    )


async def test_slow_replica_loses_no_request(replicas: list[Replica]) -> None:
    slow = f"{replicas[0].host}:{replicas[0].port}"
    async with running_gateway(fault_config([r.url for r in replicas])) as gw:
        async with httpx.AsyncClient() as http:
            await http.post(f"{replicas[0].url}/sim/faults", json={"delay_ms": 300})
        async with SteadyLoad(gw.url, WORKERS) as load:
            await asyncio.sleep(max(2.0, 3 * PHASE))
    outcomes = load.outcomes
    assert outcomes and not [o for o in outcomes if o.failed or o.hung]
    share = sum(1 for o in outcomes if o.endpoint == slow) / len(outcomes)
    print(f"\nslow replica: sent {len(outcomes)}, failed 0, hung 0, its share {share:.1%}")
    # Counted in flight for longer, the slow replica is picked less than a fair quarter.
    assert share < 0.25, share


async def test_disconnect_storm_leaves_nothing_behind() -> None:
    clients = 200
    # Few batch slots: most of the storm waits in the replicas' queues before its first token.
    async with start_replicas(4, SimConfig(speed=SPEED, max_num_seqs=16)) as replicas:
        # Flow control must not hold part of the storm back: a scrape that lands mid-storm (on
        # a slow machine) sees every replica's queue over llm-d's threshold of 5.
        config = gateway_config(
            [r.url for r in replicas],
            proxy={"maxConnections": 400},
            flowControl={"saturationDetector": {"queueDepthThreshold": 1000}},
        )
        limits = httpx.Limits(max_connections=clients + 10)
        async with (
            running_gateway(config) as gw,
            httpx.AsyncClient(base_url=gw.url, limits=limits, timeout=30) as http,
        ):
            first_chunks = 0

            async def client(i: int) -> None:
                nonlocal first_chunks
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"storm {i}"}],
                    "max_tokens": 5000,
                    "stream": True,
                }
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        first_chunks += 1
                        await asyncio.sleep(3600)

            pool = gw.gateway.pool
            tasks = [asyncio.create_task(client(i)) for i in range(clients)]
            engines = [r.engine for r in replicas]
            assert await _wait_for(lambda: sum(s.in_flight for s in pool) == clients, EVENTUALLY)
            assert await _wait_for(lambda: sum(len(e.running) for e in engines) == 64, EVENTUALLY)
            assert await _wait_for(lambda: first_chunks == 64, EVENTUALLY)
            left_at = time.monotonic()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

            def idle() -> bool:
                busy = sum(len(e.running) + len(e.waiting) for e in engines)
                return busy == 0 and all(s.in_flight == 0 for s in pool)

            assert await _wait_for(idle, EVENTUALLY), "replicas and gateway freed every slot"
            freed_after = time.monotonic() - left_at
            assert await _wait_for(lambda: gw.gateway.proxy.active == 0, EVENTUALLY)
            metrics = (await http.get("/metrics")).text
    assert sum(e.stats.requests_aborted for e in engines) == clients
    for line in metrics.splitlines():
        if line.startswith(("prefixgate_endpoint_in_flight{", "prefixgate_requests_in_flight ",
                            "prefixgate_flow_queue_requests{")):
            assert float(line.rsplit(" ", 1)[1]) == 0.0, line
    assert "prefixgate_requests_in_flight 0.0" in metrics
    print(f"\ndisconnect storm: {clients} clients left (64 mid-stream, {clients - 64} queued); "
          f"replicas and gateway idle {freed_after * 1000:.0f} ms later")
