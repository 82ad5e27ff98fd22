"""The gateway over real sockets, in front of simulated replicas, through the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from benchmarks.sim.cli import Replica
from router.app import build_gateway, gateway_running
from router.config.model import parse_config
from router.serve.http_protocol import GatewayHttpProtocol
from router.serve.server import RunningGateway, running_gateway
from tests.gateways import MODEL, gateway_config

pytestmark = pytest.mark.slow


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def replica_ids(replicas: list[Replica]) -> set[str]:
    return {f"{r.host}:{r.port}" for r in replicas}


async def test_chat_non_streaming(gateway: RunningGateway, replicas: list[Replica]) -> None:
    raw = await client(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert raw.headers["x-gateway-destination-endpoint"] in replica_ids(replicas)
    assert raw.headers["x-request-id"]


async def test_chat_streaming_is_passed_through_chunk_by_chunk(
    gateway: RunningGateway, replicas: list[Replica]
) -> None:
    stream = await client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = []
    running_at_first_content = None
    async for chunk in stream:
        if running_at_first_content is None and chunk.choices and chunk.choices[0].delta.content:
            # Unbuffered: the first token reaches the client while the replica still generates.
            running_at_first_content = sum(len(r.engine.running) for r in replicas)
        chunks.append(chunk)
    assert running_at_first_content == 1
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 60
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 60


async def test_completions_stream_and_not(gateway: RunningGateway) -> None:
    c = client(gateway)
    done = await c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
    assert done.choices[0].text
    stream = await c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert len(texts) == 4


async def test_models_health_ready_metrics(gateway: RunningGateway) -> None:
    models = await client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 200 and ready.json()["healthy_endpoints"] == 4
        await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]},
        )
        text = (await http.get("/metrics")).text
    for name in (
        "prefixgate_requests_total",
        "prefixgate_routing_decision_seconds_bucket",
        "prefixgate_endpoint_in_flight",
        "prefixgate_prefix_match_ratio_bucket",
        "prefixgate_live_session_horizon_seconds",
        "prefixgate_event_loop_lag_seconds_bucket",
        "prefixgate_log_lines_dropped_total",
    ):
        assert name in text
    # One request answered: counted once by each part of its time to first byte.
    assert "prefixgate_request_gateway_delay_seconds_count 1.0" in text
    assert "prefixgate_time_to_first_byte_seconds_count 1.0" in text


async def test_unknown_model_is_an_openai_404(gateway: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client(gateway).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 404
    body = info.value.response.json()
    assert body["error"]["code"] == "model_not_found"


async def test_bad_requests_get_openai_errors(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        bad_json = await http.post("/v1/chat/completions", content=b"{oops")
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["type"] == "invalid_request_error"
        no_messages = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert no_messages.status_code == 400
        assert no_messages.json()["error"]["param"] == "messages"
        unknown = await http.get("/v1/nothing")
        assert unknown.status_code == 404 and "error" in unknown.json()


async def test_a_bug_is_an_openai_500_not_a_plain_text_page(
    gateway: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway.gateway.proxy, "_serve", broken)
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        resp = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "internal_error"
    assert "a bug" not in resp.text  # internals stay in the log


async def test_upstream_error_is_passed_through(gateway: RunningGateway) -> None:
    # The replica rejects a prompt longer than its max_model_len: status and body come back as is.
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        resp = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [1] * 300_000, "max_tokens": 1}
        )
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/json")
    assert "error" in resp.json()
    assert "x-gateway-destination-endpoint" in resp.headers


async def test_body_limit(replicas: list[Replica]) -> None:
    config = gateway_config([r.url for r in replicas], server={"port": 0, "maxBodyBytes": 2048})
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]},
        )
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "payload_too_large"


async def test_no_healthy_endpoint_is_503_with_reason(unused_tcp_port: int) -> None:
    config = gateway_config([f"http://127.0.0.1:{unused_tcp_port}"])
    config = gateway_config(
        [f"http://127.0.0.1:{unused_tcp_port}"],
        pool={"endpoints": [{"url": f"http://127.0.0.1:{unused_tcp_port}", "models": [MODEL]}]},
    )
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        assert (await http.get("/ready")).status_code == 503
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        )
    assert resp.status_code == 503
    assert resp.headers["x-gateway-request-dropped-reason"] == "rejected-no-endpoints"


async def test_retry_on_5xx_before_first_byte(
    gateway: RunningGateway, replicas: list[Replica]
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        for r in replicas[:3]:
            faults = await http.post(f"{r.url}/sim/faults", json={"fail_rate": 1.0, "status": 500})
            assert faults.status_code == 200
        healthy = f"{replicas[3].host}:{replicas[3].port}"
        for _ in range(5):
            resp = await http.post(
                f"{gateway.url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "retry me"}]},
            )
            # max_attempts is 3 of 4 endpoints: either it reached the healthy one, or the last
            # attempt's 5xx is passed through; never a gateway crash.
            assert resp.status_code in (200, 500)
            if resp.status_code == 200:
                assert resp.headers["x-gateway-destination-endpoint"] == healthy


async def _wait_for(predicate: Callable[[], bool], seconds: float = 20.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_upstream(
    gateway: RunningGateway, replicas: list[Replica], stream: bool
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "long answer"}],
        "max_tokens": 5000,
        "stream": stream,
    }

    def running() -> int:
        return sum(len(r.engine.running) for r in replicas)

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        if stream:
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                await anext(resp.aiter_bytes())
                assert running() == 1
        else:
            task = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            assert await _wait_for(lambda: running() == 1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    # The client is gone: the replica frees the slot long before 5000 tokens are generated.
    assert await _wait_for(lambda: running() == 0)
    assert await _wait_for(lambda: all(s.in_flight == 0 for s in gateway.gateway.pool))
    assert sum(r.engine.stats.requests_aborted for r in replicas) == 1


async def test_a_client_gone_before_its_watch_starts_is_not_sent_upstream(
    gateway: RunningGateway, replicas: list[Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves after its body was read, while it is parsed (a large body's parse
    runs elsewhere): the disconnect watch, started after that, still sees it."""
    proxy = gateway.gateway.proxy
    parsing, lost = asyncio.Event(), asyncio.Event()
    prepare = proxy.preparer.prepare

    async def held(*args: Any, **kwargs: Any) -> Any:
        parsing.set()
        await lost.wait()
        return await prepare(*args, **kwargs)

    connection_lost = GatewayHttpProtocol.connection_lost

    def noticed(self: GatewayHttpProtocol, exc: Exception | None) -> None:
        mid_request = self.cycle is not None and not self.cycle.response_complete
        connection_lost(self, exc)
        if mid_request:  # not the warm-up's connections closing
            lost.set()

    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4})
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for _ in range(8):  # warm connections to every replica: a send would not wait
            assert (await http.post("/v1/completions", content=body)).status_code == 200
    assert await _wait_for(lambda: sum(r.engine.stats.requests_succeeded for r in replicas) == 8)
    opened: list[str] = []
    open_upstream = proxy.open_upstream

    async def counted(method: str, url: str, *args: Any) -> Any:
        opened.append(url)
        return await open_upstream(method, url, *args)

    monkeypatch.setattr(proxy.preparer, "prepare", held)
    monkeypatch.setattr(proxy, "open_upstream", counted)
    monkeypatch.setattr(GatewayHttpProtocol, "connection_lost", noticed)
    _reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await asyncio.wait_for(parsing.wait(), 20)
    writer.close()
    await asyncio.wait_for(lost.wait(), 20)
    assert await _wait_for(lambda: proxy.active == 0)
    assert sum(r.engine.stats.requests_succeeded for r in replicas) == 8
    assert sum(r.engine.stats.requests_aborted for r in replicas) == 0, "never sent"
    assert opened == [], "not even begun: over a warm connection it would go at once"
    registry = gateway.gateway.metrics.registry
    assert registry.get_sample_value("prefixgate_client_disconnects_total") == 1


async def test_a_client_gone_while_sending_its_body_is_a_disconnect_not_a_crash(
    gateway: RunningGateway,
) -> None:
    proxy = gateway.gateway.proxy
    _reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n{\"model\": "
    )
    await writer.drain()
    assert await _wait_for(lambda: proxy.active == 1)
    writer.close()
    assert await _wait_for(lambda: proxy.active == 0)
    registry = gateway.gateway.metrics.registry
    assert registry.get_sample_value("prefixgate_client_disconnects_total") == 1
    labels = {"endpoint": "none", "status": "499", "api": "completions"}
    assert registry.get_sample_value("prefixgate_requests_total", labels) == 1


async def test_index_predictions_are_checked_against_usage(gateway: RunningGateway) -> None:
    """Every answer's cached_tokens is compared with what the prefix index predicted."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "agent " * 400}]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} " * 50})
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": turn == 2}
            if turn == 2:
                body["stream_options"] = {"include_usage": True}
            resp = await http.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": "s1"}
            )
            assert resp.status_code == 200
            if turn < 2:
                messages.append(resp.json()["choices"][0]["message"])
        text = (await http.get("/metrics")).text
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('prefixgate_prefix_prediction_error_tokens_count{mode="approximate"}')
    ]
    assert counts == [3.0], "one comparison per answer, streaming or not"


async def test_the_previous_answer_counts_as_cached_where_it_was_generated(
    gateway: RunningGateway,
) -> None:
    """The replica caches an answer's blocks as it decodes them: the next turn's prediction
    there counts them, though no prompt the gateway indexed held them."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "agent " * 400},
        {"role": "user", "content": "write it all " * 20},
    ]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for _ in range(2):
            body = {"model": MODEL, "messages": messages, "max_tokens": 600}
            resp = await http.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": "s1"}
            )
            assert resp.status_code == 200
            answer = resp.json()
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "more"}]
        text = (await http.get("/metrics")).text
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 600
    under = 'prefixgate_prefix_prediction_error_tokens_bucket{le="-64.0",mode="approximate"}'
    assert [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(under)] == [
        "0.0"
    ], "the 600-token answer was predicted cached, to within a gateway block"


async def test_a_routing_decision_is_explained_on_request(
    replicas: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "why here? " * 50}],
            "max_tokens": 3}
    ask = {"x-prefixgate-explain": "1"}
    urls = [r.url for r in replicas]
    async with running_gateway(gateway_config(urls)) as gw, httpx.AsyncClient() as http:
        refused = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=ask)
    config = gateway_config(urls, server={"port": 0, "explainHeader": True})
    async with running_gateway(config) as gw, httpx.AsyncClient() as http:
        with caplog.at_level("DEBUG", logger="prefixgate.decision"):
            plain = await http.post(f"{gw.url}/v1/chat/completions", json=body)
            asked = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=ask)
    assert "x-prefixgate-decision" not in refused.headers, "off unless the gateway allows it"
    assert "x-prefixgate-decision" not in plain.headers, "only for a client that asks"
    decision = orjson.loads(asked.headers["x-prefixgate-decision"])
    assert decision["pick"] == asked.headers["x-gateway-destination-endpoint"]
    assert {e["id"] for e in decision["endpoints"]} == replica_ids(replicas)
    best = decision["endpoints"][0]
    assert best["id"] == decision["pick"]
    terms = best["ttft-cost-scorer.terms"]
    assert terms["uncached_tokens"] < decision["endpoints"][-1]["ttft-cost-scorer.terms"][
        "uncached_tokens"], "the second request found its prefix where the first went"
    assert {"predicted_ttft_s", "queued_tokens", "evicted_tokens", "load_s"} <= set(terms)
    logged = [r.getMessage() for r in caplog.records if r.name == "prefixgate.decision"]
    assert len(logged) == 2 and all('"pick"' in line for line in logged)


def test_the_graph_is_built_complete_and_not_finished_by_assignment() -> None:
    config = parse_config(
        {
            "pool": {"endpoints": [{"url": "http://127.0.0.1:9"}]},
            "discovery": {"apiServer": "http://127.0.0.1:9", "labelSelector": {"app": "vllm"},
                          "targetPorts": [8000]},
        }
    )
    gw = build_gateway(config)
    assert gw.proxy.client is gw.upstream, "the proxy forwards with the gateway's client"
    assert gw.monitor_client is not gw.upstream, "health checks never queue behind traffic"
    assert gw.proxy.prediction is gw.prediction and gw.proxy.sizer is gw.sizer
    assert gw.discovery is not None and not gw.discovery.synced
    with pytest.raises(dataclasses.FrozenInstanceError):
        gw.monitor = gw.monitor  # type: ignore[misc]


async def test_a_fresh_gateway_finds_a_stored_response_by_asking_the_replicas(
    replicas: list[Replica],
) -> None:
    """The probe the composition root gives the response store reaches the replicas through
    the gateway's client: a gateway that never relayed the answer still finds its holder."""
    urls = [r.url for r in replicas]
    ask = {"model": MODEL, "input": "remember this", "max_output_tokens": 4}
    async with running_gateway(gateway_config(urls)) as first:
        async with httpx.AsyncClient(base_url=first.url) as http:
            created = await http.post("/v1/responses", json=ask)
        assert created.status_code == 200
        response_id = created.json()["id"]
        home = created.headers["x-gateway-destination-endpoint"]
    async with (
        running_gateway(gateway_config(urls)) as second,
        httpx.AsyncClient(base_url=second.url) as http,
    ):
        assert second.gateway.stores.responses.local(response_id) is None
        got = await http.get(f"/v1/responses/{response_id}")
    assert got.status_code == 200 and got.json()["id"] == response_id
    assert got.headers["x-gateway-destination-endpoint"] == home


async def test_the_lifespan_closes_the_clients_it_was_given() -> None:
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": "http://127.0.0.1:9"}]}}))
    async with gateway_running(gw):
        assert not gw.monitor_client.closed and not gw.upstream.closed
    assert gw.monitor_client.closed and gw.upstream.closed


async def test_an_engine_restart_empties_the_index_and_the_live_contexts_of_its_endpoint() -> None:
    from router.core.framework import RoutingRequest
    from router.estimators.live_sessions import LiveSessions
    from router.index.prefix_index import InMemoryPrefixIndex

    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": u} for u in urls]}}))
    a, b = (state.endpoint.id for state in gw.pool)
    index = gw.stores.index
    assert isinstance(index, InMemoryPrefixIndex)
    (live,) = [p for p in gw.scheduler._producers if isinstance(p, LiveSessions)]
    for endpoint in (a, b):
        index.record(endpoint, [1, 2])
        for _ in range(2):
            request = RoutingRequest("r", "m", session_id=endpoint, prompt_tokens=100)
            live.on_pick(request, endpoint)
    restarted = gw.monitor._on_restart
    assert restarted is not None
    await restarted(a, 0.0)
    assert index.match_now([1, 2], [a, b]) == {a: 0, b: 2}
    assert (live.live_tokens(a), live.live_tokens(b)) == (0, 100)


async def test_a_restart_clears_the_index_for_the_engines_life_scraped() -> None:
    """The shared index clears an endpoint once per engine restart across gateways: the
    restart hook names the life the monitor saw (the scraped start time; None while unknown)."""
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": u} for u in urls]}}))
    a, b = (state.endpoint.id for state in gw.pool)
    cleared: list[tuple[str, str | None]] = []

    async def clear_endpoint(endpoint_id: str, life: str | None = None) -> None:
        cleared.append((endpoint_id, life))

    gw.stores.index.clear_endpoint = clear_endpoint  # type: ignore[method-assign]
    restarted = gw.monitor._on_restart
    assert restarted is not None
    await restarted(a, 1700000000.25)
    await restarted(b, 0.0)
    assert cleared == [(a, "1700000000.25"), (b, None)]


async def test_scorers_that_remember_endpoints_forget_one_that_left_the_pool() -> None:
    """Discovery's forget reaches a profile's stateful scorers as it does the index: a pod at
    the address of one that left is a new replica, which no-hit-lru-scorer never sent a new
    session to."""
    from router.core.endpoints import Endpoint
    from router.core.framework import RoutingRequest
    from router.pool.discovery import Found, LivePool
    from scorers.no_hit_lru import NoHitLRUScorer
    from tests.snapshots import snap

    lru = {"type": "no-hit-lru-scorer"}
    gw = build_gateway(parse_config({
        "discovery": {"apiServer": "http://127.0.0.1:9", "labelSelector": {"app": "vllm"},
                      "targetPorts": [9], "tokenFile": None, "namespace": "default"},
        "plugins": [lru],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": lru["type"]}]}],
    }))
    assert gw.discovery is not None
    sink, scorer = gw.discovery._sink, gw.scheduler.profile.scorers[0].scorer
    assert isinstance(sink, LivePool) and isinstance(scorer, NoHitLRUScorer)
    a, b = Endpoint.from_url("http://127.0.0.1:9"), Endpoint.from_url("http://127.0.0.2:9")
    try:
        await sink.apply({a.id: Found(a, True, "pod-1"), b.id: Found(b, True, "pod-2")})
        cold = RoutingRequest("r", "m", session_id="s", block_hashes=(1,))
        scorer.on_pick(cold, a.id)
        await sink.apply({b.id: Found(b, True, "pod-2")})
        await sink.apply({a.id: Found(a, True, "pod-3"), b.id: Found(b, True, "pod-2")})
        assert scorer.score(cold, [snap(a.id), snap(b.id)]) == [1.0, 0.0], "both never used"
    finally:
        await gw.monitor.stop()
