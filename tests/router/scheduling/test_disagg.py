"""Disaggregated prefill and decode: the decider, the bodies, the profiles, and end to end over
real sockets with 2 prefill + 2 decode simulated replicas (the simulator speaks NixlConnector:
a prefill answer carries kv_transfer_params; a decode with do_remote_prefill pulls the KV)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot, Role
from router.core.errors import ConfigError
from router.core.framework import RoutingRequest
from router.protocol.parsing import parse_request
from router.scheduling.disagg import (
    PREFILLER_HEADER,
    UncachedTokensDecider,
    build_disagg_profiles,
    decode_payload,
    kv_params_of,
    prefill_payload,
)
from router.scheduling.filters import decode_filter, prefill_filter
from router.scheduling.plugins import PluginContext, default_registry
from router.serve.server import RunningGateway, running_gateway
from tests.gateways import MODEL

ROLES: tuple[Role, ...] = ("prefill", "prefill", "decode", "decode")
THRESHOLD = 512
# ~3,000 simulator tokens; the gateway estimates ~2,000 (4 bytes a token): far over THRESHOLD.
LONG = " ".join(f"word{i}" for i in range(1000))


def snapshot(eid: str, role: Role = "both") -> EndpointSnapshot:
    return EndpointSnapshot(eid, f"http://{eid}", role, 0, 0, 0.0, 0.0, 0.0, 0.0)


# -- units -------------------------------------------------------------------------------------


def test_prefill_payload_asks_for_one_unstreamed_token_and_keeps_the_original() -> None:
    original = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 300,
        "max_completion_tokens": 300,
        "min_tokens": 20,
        "temperature": 0.5,
    }
    out = prefill_payload(original)
    assert out["stream"] is False and "stream_options" not in out and "min_tokens" not in out
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    assert out["temperature"] == 0.5 and out["messages"] == original["messages"]
    assert original["stream"] is True and original["max_tokens"] == 300  # not mutated
    completion = prefill_payload({"model": MODEL, "prompt": "x"})
    assert "max_completion_tokens" not in completion and completion["max_tokens"] == 1


def test_decode_payload_is_the_original_plus_the_handed_over_params() -> None:
    original = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 9}
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 9}
    out = decode_payload(original, params)
    assert out == {**original, "kv_transfer_params": params}
    assert "kv_transfer_params" not in original


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (b'{"kv_transfer_params": {"do_remote_prefill": true}}', {"do_remote_prefill": True}),
        (b'{"kv_transfer_params": null}', None),
        (b'{"kv_transfer_params": {}}', None),
        (b'{"choices": []}', None),
        (b"[1, 2]", None),
        (b"not json", None),
    ],
)
def test_kv_params_of(answer: bytes, expected: dict[str, Any] | None) -> None:
    assert kv_params_of(answer) == expected


def test_decider_counts_uncached_tokens_on_the_decode_pick() -> None:
    # 40 blocks of 256 bytes: 2,560 tokens; the decode pick holds 36 blocks of them.
    request = RoutingRequest(
        "r", MODEL, prompt_bytes=40 * 256, prompt_tokens=2560, block_bytes=256,
        block_hashes=list(range(40)), prefix_hits={"warm:1": 36},
    )
    decider = UncachedTokensDecider(512)
    assert decider.needs_prefill(request, snapshot("cold:1"))  # 2,560 uncached
    assert not decider.needs_prefill(request, snapshot("warm:1"))  # 256 uncached
    assert UncachedTokensDecider(256).needs_prefill(request, snapshot("warm:1"))


def test_role_filters() -> None:
    pool = [snapshot("p:1", "prefill"), snapshot("d:1", "decode"), snapshot("b:1", "both")]
    request = RoutingRequest("r", MODEL)
    assert [e.id for e in prefill_filter().filter(request, pool)] == ["p:1", "b:1"]
    assert [e.id for e in decode_filter().filter(request, pool)] == ["d:1", "b:1"]


def test_config_defaults_and_errors() -> None:
    pd = parse_config({}).disaggregation
    assert not pd.enabled and pd.non_cached_tokens == 1024 and pd.mode == "two-step"
    parsed = parse_config(
        {"disaggregation": {"enabled": True, "nonCachedTokens": 64, "mode": "sidecar",
                            "prefillTimeoutSeconds": 5}}
    ).disaggregation
    assert (parsed.non_cached_tokens, parsed.mode, parsed.prefill_timeout_seconds) == (
        64, "sidecar", 5
    )
    with pytest.raises(ConfigError, match=r"disaggregation\.mode"):
        parse_config({"disaggregation": {"mode": "three-step"}})
    with pytest.raises(ConfigError, match="missing: prefill"):
        parse_config({
            "disaggregation": {"enabled": True},
            "plugins": [{"type": "queue-scorer"}],
            "schedulingProfiles": [{"name": "decode", "plugins": [{"pluginRef": "queue-scorer"}]}],
        })


def test_profiles_have_their_own_weights_and_role_filters() -> None:
    config = parse_config({
        "disaggregation": {"enabled": True},
        "plugins": [{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"},
                    {"type": "decode-filter"}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefix-cache-scorer", "weight": 5}]},
            {"name": "decode", "plugins": [{"pluginRef": "queue-scorer", "weight": 2},
                                           {"pluginRef": "decode-filter"}]},
        ],
    })
    assert config.plugins is not None and config.scheduling_profiles is not None
    decode, prefill = build_disagg_profiles(
        config.plugins, config.scheduling_profiles, default_registry(),
        PluginContext(random.Random(0)),
    )
    assert [(s.name, s.weight) for s in decode.scorers] == [("queue-scorer", 2.0)]
    assert [(s.name, s.weight) for s in prefill.scorers] == [("prefix-cache-scorer", 5.0)]
    pool = [snapshot("p:1", "prefill"), snapshot("d:1", "decode")]
    request = RoutingRequest("r", MODEL)
    assert [e.id for e in decode.run(request, pool).ranked] == ["d:1"]
    assert [e.id for e in prefill.run(request, pool).ranked] == ["p:1"]


# -- end to end --------------------------------------------------------------------------------


def pd_config(replicas: list[Replica], **disagg: Any) -> Any:
    endpoints = [{"url": r.url, "role": role} for r, role in zip(replicas, ROLES, strict=True)]
    return parse_config({
        "server": {"port": 0},
        "pool": {
            "endpoints": endpoints,
            "healthCheck": {"intervalSeconds": 0.2, "unhealthyThreshold": 2},
            "metricsScrape": {"intervalSeconds": 0.05},
            "speedProbe": {"enabled": False},  # the tests count what each replica gets
        },
        "seed": 1,
        "disaggregation": {"enabled": True, "nonCachedTokens": THRESHOLD, **disagg},
    })


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    async with start_replicas(4, SimConfig(speed=20.0)) as reps:
        yield reps


@contextlib.asynccontextmanager
async def pd_gateway(replicas: list[Replica], **disagg: Any) -> AsyncIterator[RunningGateway]:
    async with running_gateway(pd_config(replicas, **disagg)) as gw:
        yield gw


def eid(replica: Replica) -> str:
    return f"{replica.host}:{replica.port}"


def served(replicas: list[Replica]) -> list[int]:
    return [r.engine.stats.requests_succeeded for r in replicas]


def ttft_sum(replica: Replica) -> float:
    value = replica.sim.metrics.registry.get_sample_value(
        "vllm:time_to_first_token_seconds_sum", {"model_name": MODEL}
    )
    return value or 0.0


def metric(gw: RunningGateway, name: str, labels: dict[str, str] | None = None) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


def client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


async def chat(http: httpx.AsyncClient, messages: list[dict[str, str]], **extra: Any) -> Any:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    return await http.post("/v1/chat/completions", json=body)


async def set_faults(replicas: list[Replica], **faults: Any) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for r in replicas:
            (await http.post(f"{r.url}/sim/faults", json=faults)).raise_for_status()


@pytest.mark.slow
async def test_long_prompts_take_two_steps_short_and_cached_ones_go_straight_to_decode(
    replicas: list[Replica],
) -> None:
    prefill, decode = replicas[:2], replicas[2:]
    async with pd_gateway(replicas) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        first = await chat(http, [{"role": "user", "content": LONG}])
        assert first.status_code == 200
        home = first.headers["x-gateway-destination-endpoint"]
        assert home in {eid(r) for r in decode}
        assert sum(served(prefill)) == 1 and sum(served(decode)) == 1
        # The decode endpoint pulled the KV instead of computing it: a fraction of the time
        # to first token the prefill endpoint took for the same prompt.
        warm = next(r for r in decode if eid(r) == home)
        assert ttft_sum(warm) < sum(ttft_sum(r) for r in prefill) / 3
        usage = first.json()["usage"]
        assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 2000

        short = await chat(http, [{"role": "user", "content": "hi"}])
        assert short.status_code == 200 and sum(served(prefill)) == 1

        # The next turn of the conversation: its context sits on the decode endpoint already.
        answer = first.json()["choices"][0]["message"]["content"]
        turn = [{"role": "user", "content": LONG}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "and then?"}]
        second = await chat(http, turn)
        assert second.status_code == 200 and sum(served(prefill)) == 1
        assert second.headers["x-gateway-destination-endpoint"] == home
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000

        probe = parse_request("chat", orjson.dumps({"model": MODEL, "messages": turn[:1]}))
        routing = gw.gateway.router.routing_request(probe, {}, "probe")
        picked_prefill = next(eid(r) for r in prefill if r.engine.stats.requests_succeeded)
        hits = await gw.gateway.stores.index.match(routing.block_hashes, [home, picked_prefill])
        assert hits[home] == hits[picked_prefill] == len(routing.block_hashes)
        decision = "prefixgate_disagg_decision_total"
        assert metric(gw, decision, {"decision": "prefill_decode"}) == 1
        assert metric(gw, decision, {"decision": "decode_only"}) == 2


@pytest.mark.slow
async def test_streaming_and_usage_are_intact_through_the_openai_client(
    replicas: list[Replica],
) -> None:
    async with pd_gateway(replicas) as gw:
        c = client(gw)
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=40,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        content = [x for x in chunks if x.choices and x.choices[0].delta.content]
        assert len(content) == 40 and chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
        assert chunks[-1].usage.prompt_tokens > 2000

        done = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "again " + LONG}],
            max_completion_tokens=7,
        )
        assert done.usage is not None and done.usage.completion_tokens == 7

        texts = [
            x.choices[0].text
            async for x in await c.completions.create(
                model=MODEL, prompt="completion " + LONG, max_tokens=6, stream=True
            )
            if x.choices
        ]
        assert len(texts) == 6
        plain = await c.completions.create(model=MODEL, prompt="plain " + LONG, max_tokens=3)
        assert plain.usage is not None and plain.usage.completion_tokens == 3
        assert metric(gw, "prefixgate_disagg_decision_total", {"decision": "prefill_decode"}) == 4
        assert sum(served(replicas[:2])) == 4
        # The prefill answers taught the cost model; the decode endpoints' first tokens, which
        # waited for KV pulls, did not.
        registry = gw.gateway.metrics.registry
        calibrated = "prefixgate_calibrated_prefill_overhead_seconds"
        learned = {
            eid(r) for r in replicas
            if registry.get_sample_value(calibrated, {"endpoint": eid(r)}) is not None
        }
        assert learned and learned <= {eid(r) for r in replicas[:2]}


@pytest.mark.slow
async def test_prefill_5xx_falls_back_to_a_plain_decode_request(replicas: list[Replica]) -> None:
    await set_faults(replicas[:2], fail_rate=1.0, status=503)
    async with pd_gateway(replicas) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        response = await chat(http, [{"role": "user", "content": LONG}], stream=True)
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        assert sum(served(replicas[:2])) == 0 and sum(served(replicas[2:])) == 1
        assert metric(gw, "prefixgate_disagg_fallbacks_total", {"reason": "5xx"}) == 1


@pytest.mark.slow
async def test_prefill_timeout_falls_back_and_cancels_the_prefill(
    replicas: list[Replica],
) -> None:
    await set_faults(replicas[:2], hang=True)
    async with pd_gateway(replicas, prefillTimeoutSeconds=0.3) as gw, httpx.AsyncClient(
        base_url=gw.url, timeout=30
    ) as http:
        response = await chat(http, [{"role": "user", "content": LONG}])
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert metric(gw, "prefixgate_disagg_fallbacks_total", {"reason": "timeout"}) == 1
        assert all(s.in_flight == 0 for s in gw.gateway.pool)


@pytest.mark.slow
async def test_prefill_4xx_goes_back_to_the_client(replicas: list[Replica]) -> None:
    config = pd_config(replicas)
    config = config.model_copy(update={"flow_control": type(config.flow_control)(enabled=True)})
    async with (
        running_gateway(config) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        # The gateway accepts n=2; the (simulated) prefill endpoint does not.
        response = await chat(http, [{"role": "user", "content": LONG}], n=2, stream=True)
        assert response.status_code == 400
        assert response.headers["content-type"].startswith("application/json")
        assert "n=1" in response.json()["error"]["message"]
        assert response.headers["x-gateway-destination-endpoint"] in {
            eid(r) for r in replicas[:2]
        }
        assert sum(served(replicas[2:])) == 0
        assert metric(gw, "prefixgate_disagg_fallbacks_total", {"reason": "5xx"}) == 0
        # The answer was made here, not relayed: its admission ticket is released with it.
        assert gw.gateway.flow.outstanding(MODEL) == 0 and gw.gateway.proxy.active == 0


@pytest.mark.slow
async def test_decode_failure_before_the_first_byte_retries_another_decode_endpoint(
    replicas: list[Replica],
) -> None:
    await set_faults(replicas[2:3], fail_rate=1.0, status=500)
    async with pd_gateway(replicas) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        for i in range(20):  # until the faulty decode endpoint has been tried first once
            response = await chat(http, [{"role": "user", "content": f"{i} {LONG}"}])
            assert response.status_code == 200
            assert response.headers["x-gateway-destination-endpoint"] == eid(replicas[3])
            if metric(gw, "prefixgate_retries_total"):
                break
        assert metric(gw, "prefixgate_retries_total") >= 1
        # The retried decode request still carried the prefill's kv_transfer_params.
        assert ttft_sum(replicas[3]) < sum(ttft_sum(r) for r in replicas[:2]) / 3


class HeaderRecorder:
    """Wraps a replica's ASGI app and keeps the headers of its generation requests."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Any]) -> None:
        self.app = app
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("completions"):
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@pytest.mark.slow
async def test_sidecar_mode_names_the_prefiller_in_a_header(replicas: list[Replica]) -> None:
    recorders = []
    for r in replicas[2:]:
        # Connections opened from now on (all of the gateway's) get the wrapped app.
        recorder = HeaderRecorder(r.server.config.loaded_app)
        r.server.config.loaded_app = recorder
        recorders.append(recorder)
    async with pd_gateway(replicas, mode="sidecar") as gw, httpx.AsyncClient(
        base_url=gw.url, timeout=30
    ) as http:
        long = await chat(http, [{"role": "user", "content": LONG}])
        short = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2},
            headers={PREFILLER_HEADER: "169.254.169.254:80"},  # never honoured from a client
        )
        assert long.status_code == short.status_code == 200
        seen = [h for rec in recorders for h in rec.seen]
        assert len(seen) == 2
        prefillers = [h.get(PREFILLER_HEADER) for h in seen]
        assert prefillers.count(None) == 1
        assert {p for p in prefillers if p} <= {eid(r) for r in replicas[:2]}
        assert sum(served(replicas[:2])) == 0  # the sidecar, not the gateway, runs prefill
        await asyncio.sleep(0)
        assert all(s.in_flight == 0 for s in gw.gateway.pool)


@pytest.mark.slow
async def test_a_client_leaving_during_prefill_releases_its_leases(
    replicas: list[Replica],
) -> None:
    await set_faults(replicas[:2], hang=True)
    async with pd_gateway(replicas) as gw, httpx.AsyncClient(base_url=gw.url, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            await chat(http, [{"role": "user", "content": LONG}])
        pool, proxy = gw.gateway.pool, gw.gateway.proxy
        for _ in range(250):
            if proxy.active == 0 and all(s.in_flight == 0 for s in pool):
                break
            await asyncio.sleep(0.02)
        assert proxy.active == 0 and all(s.in_flight == 0 for s in pool)
        assert metric(gw, "prefixgate_client_disconnects_total") == 1
        assert sum(served(replicas)) == 0
