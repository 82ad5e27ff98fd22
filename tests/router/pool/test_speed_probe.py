"""The speed probe: timed on an injected clock through a test double of the client, and end to
end against simulated replicas (that each endpoint is timed, not how fast)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import httpx
import orjson
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import Endpoint, EndpointState
from router.pool.speed_probe import SpeedProbe
from router.serve.server import running_gateway
from router.upstream.client import Fetched, UpstreamClient
from tests.gateways import gateway_config
from tests.manual_clock import ManualClock


class ScriptedClient:
    """Answers each POST at once, moving the clock by the endpoint's next scripted time."""

    def __init__(
        self, clock: ManualClock, times: Mapping[str, Sequence[float | int | Exception]]
    ) -> None:
        self.clock = clock
        self.times = {url: list(ts) for url, ts in times.items()}
        self.sent: list[tuple[str, list[tuple[str, str]], dict[str, object]]] = []

    async def fetch(
        self, method: str, url: str, headers: Sequence[tuple[str, str]] = (), body: bytes = b"",
        *, seconds: float, limit: int = 1 << 20,
    ) -> Fetched:
        assert method == "POST" and seconds > 0
        base = url.removesuffix("/v1/completions")
        self.sent.append((url, list(headers), orjson.loads(body)))
        step = self.times[base].pop(0)
        if isinstance(step, Exception):
            raise step
        if isinstance(step, int):  # a status, not a time
            return Fetched(step, b"{}")
        self.clock.now += step
        return Fetched(200, b'{"choices": [{"text": "x"}]}')


def _state(url: str, models: set[str] | None = None) -> EndpointState:
    state = EndpointState(Endpoint.from_url(url))
    state.models.update(models if models is not None else {"m"})
    return state


async def _probe_all(
    times: Mapping[str, Sequence[float | int | Exception]],
    states: Sequence[EndpointState],
    **kw: object,
) -> tuple[dict[str, float], ScriptedClient]:
    clock = ManualClock()
    client = ScriptedClient(clock, times)
    probed: dict[str, float] = {}
    probe = SpeedProbe(
        client,  # type: ignore[arg-type]
        probed.__setitem__, clock=clock, nonce=iter(f"n{i}" for i in range(99)).__next__,
        **kw,  # type: ignore[arg-type]
    )
    for state in states:
        probe.endpoint_up(state)
    await probe.settle(5.0)
    await probe.stop()
    return probed, client


async def test_the_fastest_of_each_endpoints_requests_is_reported() -> None:
    a, b = "http://127.0.0.1:1001", "http://127.0.0.1:1002"
    probed, client = await _probe_all(
        {a: [0.05, 0.02, 0.03], b: [0.09, 0.06, 0.30]}, [_state(a), _state(b)],
        prompt_bytes=100, auth_headers=lambda e: {"authorization": f"Bearer {e}"},
    )
    assert probed == pytest.approx({"127.0.0.1:1001": 0.02, "127.0.0.1:1002": 0.06})
    assert len(client.sent) == 6
    prompts = [body["prompt"] for _, _, body in client.sent]
    # Each prompt its own from the first byte on (no cache holds any of it), of the size asked.
    assert len({p[:3] for p in prompts}) == 6  # type: ignore[index]
    assert all(len(p) == 100 for p in prompts)  # type: ignore[arg-type]
    _, headers, body = client.sent[0]
    assert body["max_tokens"] == 1 and body["model"] == "m"
    assert ("authorization", "Bearer 127.0.0.1:1001") in headers


async def test_an_endpoint_that_fails_or_serves_nothing_is_not_timed() -> None:
    a, b, c = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
    probed, client = await _probe_all(
        {a: [0.02, 404], b: [500], c: []}, [_state(a), _state(b), _state(c, set())]
    )
    # a answered one before failing: that one counts; b none; c lists no model to ask for.
    assert probed == {"127.0.0.1:1001": 0.02}
    assert [url for url, _, _ in client.sent] == [
        f"{a}/v1/completions", f"{a}/v1/completions", f"{b}/v1/completions",
    ]


async def test_a_refused_connection_or_a_bug_ends_that_endpoints_probe_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b, c = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
    probed, _ = await _probe_all(
        {a: [ConnectionRefusedError()], b: [ValueError("bug")], c: [0.01, 0.01, 0.01]},
        [_state(a), _state(b), _state(c)],
    )
    assert probed == pytest.approx({"127.0.0.1:1003": 0.01})
    assert "127.0.0.1:1002: speed probe failed" in caplog.text


async def test_a_configured_model_is_asked_for_and_one_probe_runs_at_a_time() -> None:
    clock = ManualClock()
    url = "http://127.0.0.1:1001"
    client = ScriptedClient(clock, {url: [0.01, 0.01]})
    started = asyncio.Event()
    release = asyncio.Event()
    fetch = client.fetch

    async def held(*args: object, **kw: object) -> Fetched:
        started.set()
        await release.wait()
        return await fetch(*args, **kw)  # type: ignore[arg-type]

    client.fetch = held  # type: ignore[method-assign]
    probed: dict[str, float] = {}
    probe = SpeedProbe(client, probed.__setitem__, requests=2, clock=clock)  # type: ignore[arg-type]
    state = EndpointState(Endpoint.from_url(url, models=["b-model", "a-model"]))
    probe.endpoint_up(state)
    await started.wait()
    probe.endpoint_up(state)  # back up again while its probe runs: not a second one
    release.set()
    await probe.settle(5.0)
    assert probed == {"127.0.0.1:1001": 0.01}
    assert [body["model"] for _, _, body in client.sent] == ["a-model", "a-model"]
    await probe.stop()


async def test_the_gateway_times_every_replica_before_it_is_ready() -> None:
    async with start_replicas(2, SimConfig(speed=50.0)) as replicas:
        config = gateway_config([r.url for r in replicas], speed_probe=True)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            ready = await http.get("/ready")
            assert ready.status_code == 200
            text = (await http.get("/metrics")).text
            probes = [line for line in text.splitlines()
                      if line.startswith("prefixgate_speed_probe_seconds{")]  # fmt: skip
            assert len(probes) == 2
            assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in probes)


async def test_the_probe_can_be_turned_off() -> None:
    async with start_replicas(1, SimConfig(speed=50.0)) as replicas:
        urls = [{"url": r.url} for r in replicas]
        config = gateway_config([], pool={"endpoints": urls, "speedProbe": {"enabled": False}})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            assert gw.gateway.speed_probe is None
            text = (await http.get("/metrics")).text
            assert "prefixgate_speed_probe_seconds{" not in text


def test_the_client_double_matches_the_real_clients_fetch() -> None:
    import inspect

    real = inspect.signature(UpstreamClient.fetch)
    double = inspect.signature(ScriptedClient.fetch)
    assert list(real.parameters) == list(double.parameters)
