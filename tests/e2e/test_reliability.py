"""Passive health, timeouts, header hygiene and regressions for failures seen in peer routers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.sim.cli import Replica
from router.core.endpoints import Endpoint
from router.core.pool import EndpointPool, OutlierSettings
from router.serve.server import RunningGateway, running_gateway
from tests.e2e.test_reliability_support import Canary, echo_upstream
from tests.gateways import MODEL, gateway_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(n: int, clock: Clock, percent: float = 50.0) -> EndpointPool:
    settings = OutlierSettings(
        consecutive_failures=3, base_ejection=10.0, max_ejection=35.0, max_ejection_percent=percent
    )
    endpoints = [Endpoint.from_url(f"http://127.0.0.1:{9000 + i}", models=["m"]) for i in range(n)]
    pool = EndpointPool(endpoints, clock=clock, outliers=settings)
    for state in pool:
        state.healthy = True
    return pool


def fail(pool: EndpointPool, endpoint_id: str, times: int) -> bool:
    ejected = False
    for _ in range(times):
        lease = pool.lease(endpoint_id)
        ejected = lease.upstream_failed() or ejected
        lease.release()
    return ejected


def candidate_ids(pool: EndpointPool) -> set[str]:
    return {s.id for s in pool.candidates("m")}


def test_ejection_needs_consecutive_failures() -> None:
    pool = make_pool(4, Clock())
    eid = "127.0.0.1:9000"
    assert not fail(pool, eid, 2)
    pool.lease(eid).upstream_ok()  # a success (any status below 500) ends the streak
    assert not fail(pool, eid, 2)
    assert eid in candidate_ids(pool)
    assert fail(pool, eid, 1)
    assert eid not in candidate_ids(pool) and len(candidate_ids(pool)) == 3


def test_ejection_is_capped_and_never_takes_the_last() -> None:
    pool = make_pool(4, Clock(), percent=50.0)
    ejected = [fail(pool, f"127.0.0.1:{9000 + i}", 3) for i in range(4)]
    assert ejected == [True, True, False, False]
    two = make_pool(2, Clock(), percent=100.0)
    assert [fail(two, f"127.0.0.1:{9000 + i}", 3) for i in range(2)] == [True, False]
    # A tiny percentage still allows one (as Envoy); zero disables ejection.
    assert fail(make_pool(4, Clock(), percent=1.0), "127.0.0.1:9000", 3)
    assert not fail(make_pool(4, Clock(), percent=0.0), "127.0.0.1:9000", 3)


def test_ejection_time_grows_readmission_is_half_open_and_decays() -> None:
    clock = Clock()
    pool = make_pool(4, clock)
    eid = "127.0.0.1:9000"
    state = pool.get(eid)
    assert state is not None
    durations = []
    for _ in range(4):
        assert fail(pool, eid, 3 if not durations else 1)  # after readmission: one is enough
        durations.append(state.ejected_until - clock.now)
        assert not pool.ejection_expired(state)
        clock.now = state.ejected_until
        assert pool.ejection_expired(state)
        pool.readmit(state)
        assert eid in candidate_ids(pool)
    assert durations == [10.0, 20.0, 30.0, 35.0]  # base x times ejected, capped at the max
    # Served 25 s (2.5 base times) without ejection: the multiplier drops by two.
    clock.now += 25.0
    assert fail(pool, eid, 1)
    assert state.ejected_until - clock.now == 30.0
    pool.extend_ejection(state)  # a failed probe: another base time out
    assert state.ejected_until - clock.now == 10.0


async def _post(http: httpx.AsyncClient, body: dict[str, Any] = CHAT) -> httpx.Response:
    return await http.post("/v1/chat/completions", json=body)


async def _wait_for(predicate: Callable[[], bool], seconds: float = 20.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def outliers(**kw: Any) -> dict[str, Any]:
    return {
        "outlierDetection": {"consecutiveFailures": 2, "baseEjectionSeconds": 0.3, **kw},
        "healthCheck": {"intervalSeconds": 0.2, "unhealthyThreshold": 2},
        "metricsScrape": {"intervalSeconds": 0.05},
    }


def ids(replicas: list[Replica]) -> list[str]:
    return [f"{r.host}:{r.port}" for r in replicas]


async def test_client_4xx_never_counts_against_a_replica(replicas: list[Replica]) -> None:
    pool = {"endpoints": [{"url": r.url} for r in replicas], **outliers()}
    config = gateway_config([], pool=pool)
    too_big = {**CHAT, "max_tokens": 10**9}  # every replica rejects it with a 400
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        statuses = [(await _post(http, too_big)).status_code for _ in range(12)]
        failures = gw.gateway.metrics.upstream_failures.collect()[0].samples
    assert statuses == [400] * 12
    assert all(s.eligible and s.failure_streak == 0 for s in gw.gateway.pool)
    assert not [s for s in failures if s.value > 0]


async def test_5xx_ejects_and_the_probe_readmits(replicas: list[Replica]) -> None:
    pool = {"endpoints": [{"url": r.url} for r in replicas], **outliers(maxEjectionSeconds=0.6)}
    bad = ids(replicas)[0]
    async with (
        running_gateway(gateway_config([], pool=pool)) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        await http.post(f"{replicas[0].url}/sim/faults", json={"fail_rate": 1.0, "status": 503})
        state = gw.gateway.pool.get(bad)
        assert state is not None
        statuses = []
        for _ in range(40):
            statuses.append((await _post(http)).status_code)
            if state.ejected:
                break
        assert state.ejected, "two 5xx in a row eject"
        assert set(statuses) == {200}, "retries hid every 5xx from the clients"
        after = [(await _post(http)).headers["x-gateway-destination-endpoint"] for _ in range(8)]
        assert bad not in after
        await http.delete(f"{replicas[0].url}/sim/faults")
        assert await _wait_for(lambda: not state.ejected), "probed back in after its time"
        back = [(await _post(http)).headers["x-gateway-destination-endpoint"] for _ in range(12)]
        ejections = gw.gateway.metrics.registry.get_sample_value(
            "prefixgate_endpoint_ejections_total", {"endpoint": bad}
        )
    assert bad in back, "a readmitted endpoint takes traffic again"
    # Readmitted while still failing (its health check passes), it is ejected again at once.
    assert ejections is not None and ejections >= 1


async def test_a_hung_replica_hangs_no_request(replicas: list[Replica]) -> None:
    pool = {"endpoints": [{"url": r.url} for r in replicas], **outliers(baseEjectionSeconds=30)}
    config = gateway_config([], pool=pool, proxy={"firstByteTimeoutSeconds": 1.0})
    hung = ids(replicas)[0]
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        await http.post(f"{replicas[0].url}/sim/faults", json={"hang": True})
        async with asyncio.timeout(15):
            first = await asyncio.gather(*(_post(http) for _ in range(12)))
            second = await asyncio.gather(*(_post(http) for _ in range(12)))
        state = gw.gateway.pool.get(hung)
        assert state is not None and state.ejected
        timeouts = gw.gateway.metrics.registry.get_sample_value(
            "prefixgate_upstream_failures_total", {"endpoint": hung, "kind": "timeout"}
        )
    assert [r.status_code for r in first + second] == [200] * 24
    assert all(r.headers["x-gateway-destination-endpoint"] != hung for r in first + second)
    # Ejected after its second timeout: the second round never waited on it.
    assert timeouts is not None and 2 <= timeouts <= 12


async def test_errors_on_stream_requests_stay_json(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        upstream = await _post(http, {**CHAT, "stream": True, "max_tokens": 10**9})
        ours = await _post(http, {**CHAT, "stream": True, "model": "nope"})
    for resp, status in ((upstream, 400), (ours, 404)):
        assert resp.status_code == status
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["message"]


async def test_abnormal_stream_ends_leak_no_connection_slot() -> None:
    async with echo_upstream() as echo:
        echo.stall_streams = True
        config = gateway_config(
            [echo.url],
            proxy={"maxConnections": 2, "idleTimeoutSeconds": 0.2, "connectTimeoutSeconds": 1},
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            for _ in range(4):  # the replica goes silent mid-stream: idle timeout
                resp = await _post(http, {**CHAT, "stream": True})
                assert resp.status_code == 200
                events = [e for e in resp.text.split("\n\n") if e]
                assert events[0] == 'data: {"choices": []}'
                assert orjson.loads(events[-1][len("data: ") :])["error"]["code"] == 502
            for _ in range(4):  # the client leaves mid-stream
                async with http.stream("POST", "/v1/chat/completions", json=CHAT) as stream:
                    await anext(stream.aiter_bytes())
            assert await _wait_for(lambda: echo.open_streams == 0)
            echo.stall_streams = False
            async with asyncio.timeout(5):
                done = await asyncio.gather(*(_post(http) for _ in range(4)))
    assert [r.status_code for r in done] == [200] * 4
    assert all(s.in_flight == 0 for s in gw.gateway.pool)


async def test_routing_headers_never_reach_nor_steer_upstream() -> None:
    async with echo_upstream() as echo, Canary() as canary:
        config = gateway_config([echo.url])
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            steer = {
                "x-gateway-destination-endpoint": canary.address,
                "x-gateway-destination-endpoint-subset": canary.address,
                "x-gateway-destination-endpoint-fallback": canary.address,
                "x-prefiller-host-port": canary.address,
                "x-prefiller-url": f"http://{canary.address}",
                "x-llm-d-prefiller-host-port": canary.address,
                "x-kv-cache-source-host-port": canary.address,
                "x-llm-d-kv-cache-source-host-port": canary.address,
                "x-encoder-hosts-ports": canary.address,
                "x-llm-d-encoder-hosts-ports": canary.address,
                "x-data-parallel-host-port": canary.address,
                "x-gateway-request-dropped-reason": "x",
                "x-prefixgate-explain": "1",
                "x-prefixgate-decision": "{}",
                "proxy-authorization": "Basic x",
                "x-custom": "kept",
            }
            body = {**CHAT, "kv_transfer_params": {"remote_host": "127.0.0.1",
                                                   "remote_port": canary.port}}
            resp = await http.post("/v1/chat/completions", json=body, headers=steer)
    assert resp.status_code == 200
    assert resp.headers["x-gateway-destination-endpoint"] == echo.url.removeprefix("http://")
    assert canary.connections == 0, "the gateway never connects outside its pool"
    received = echo.received[0]
    for name in steer:
        if name != "x-custom":
            assert name not in received, name
    assert received["x-custom"] == "kept"
    assert received["host"] == echo.url.removeprefix("http://")


@pytest.mark.parametrize(
    ("sent", "honoured"),
    [("abc-123.X:9", True), ("a b", False), ("x" * 200, False), ("é".encode(), False),
     (None, False)],
)
async def test_request_id_honoured_only_when_plain(
    sent: str | bytes | None, honoured: bool
) -> None:
    async with (
        echo_upstream() as echo, running_gateway(gateway_config([echo.url])) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        headers: dict[str, str | bytes] = {} if sent is None else {"x-request-id": sent}
        resp = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
    rid = resp.headers["x-request-id"]
    assert echo.received[0]["x-request-id"] == rid
    assert (rid == sent) is honoured
    if not honoured:
        assert len(rid) == 32


async def test_a_body_that_never_arrives_is_a_408() -> None:
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "bodyTimeoutSeconds": 0.3})
        async with running_gateway(config) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\""
            )
            await writer.drain()
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            assert await _wait_for(lambda: gw.gateway.proxy.active == 0)
    assert head.startswith(b"HTTP/1.1 408")
    assert not echo.received


MODELS_BODY = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


@contextlib.asynccontextmanager
async def dying_upstream(chunked: bool) -> Any:
    """Answers GETs (health, models); every POST gets half a JSON answer, then a hang-up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for _ in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    body = MODELS_BODY if b"/v1/models" in head else b""
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    continue
                part = b'{"id":"cmpl-1","choices":[{"text":"hello'
                framing = (
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(part), part)
                    if chunked else b"content-length: 1000\r\n\r\n" + part
                )
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + framing)
                await writer.drain()
                break  # the replica dies mid-answer
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_json_answer_cut_mid_body_reaches_the_client_as_cut(chunked: bool) -> None:
    async with (
        dying_upstream(chunked) as url,
        running_gateway(gateway_config([url])) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=20) as http,
    ):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post("/v1/completions", json=body)
        errors = gw.gateway.metrics.registry.get_sample_value(
            "prefixgate_stream_errors_total", {"endpoint": url.removeprefix("http://")}
        )
        assert errors == 1, "counted as the endpoint's stream error (outlier detection sees it)"
