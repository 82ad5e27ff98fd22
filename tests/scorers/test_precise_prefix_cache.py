"""Precise prefix routing end to end: the scorer, speculation in bursts, routing by the replicas'
real caches after eviction, and the prediction error of both indexes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.engine import Engine
from router.api.prediction import PredictionTracker
from router.api.usage_tap import find_usage
from router.app import build_gateway
from router.config.model import parse_config
from router.core.endpoints import endpoint_id_from_url
from router.core.errors import ConfigError
from router.core.framework import RoutingRequest
from router.precise.routing import PreciseRouter
from router.protocol.parsing import parse_request
from router.serve.server import RunningGateway, running_gateway
from scorers.precise_prefix_cache import PrecisePrefixCacheScorer
from tests.gateways import MODEL, gateway_config
from tests.router.precise.test_kv_events import wait_for
from tests.snapshots import FixedScores, snap

pytestmark = pytest.mark.slow


def test_scorer_uses_precise_scores_else_the_approximate_share() -> None:
    request = RoutingRequest("r", MODEL, block_hashes=[1, 2, 3, 4], prefix_hits={"a": 2})
    endpoints = [snap("a"), snap("b")]
    assert PrecisePrefixCacheScorer(FixedScores([0.25, 1.0])).score(request, endpoints) == [
        0.25, 1.0
    ]
    assert PrecisePrefixCacheScorer(FixedScores(None)).score(request, endpoints) == [0.5, 0.0]
    assert PrecisePrefixCacheScorer(None).score(RoutingRequest("r", MODEL), endpoints) == [0, 0]


def eid(replica: Replica) -> str:
    return endpoint_id_from_url(replica.url)


@asynccontextmanager
async def precise_fleet(
    n: int, speculative_ttl: float = 5.0, **sim: Any
) -> AsyncIterator[tuple[list[Replica], RunningGateway]]:
    config = SimConfig(speed=50.0, kv_events_port=0, kv_events_replay_port=0, **sim)
    async with start_replicas(n, config) as replicas:
        endpoints = {
            eid(r): {"address": r.kv_events_address, "replayAddress": r.kv_events_replay_address}
            for r in replicas
        }
        cfg = gateway_config(
            [r.url for r in replicas],
            plugins=[{"type": "precise-prefix-cache-scorer"}, {"type": "max-score-picker"}],
            schedulingProfiles=[{
                "name": "p",
                "plugins": [{"pluginRef": "precise-prefix-cache-scorer", "weight": 1},
                            {"pluginRef": "max-score-picker"}],
            }],
            precisePrefix={
                "speculativeTtlSeconds": speculative_ttl,
                "tokenizer": {"type": "sim"},
                "kvEvents": {"endpoints": endpoints, "resyncSeconds": 0.5},
            },
        )
        async with running_gateway(cfg) as gw:
            precise = gw.gateway.precise
            assert precise is not None
            async with asyncio.timeout(10):
                while not all(precise.index.trusted(eid(r)) for r in replicas):
                    for r in replicas:  # probe until every subscription is live
                        assert r.sim.kv_publisher is not None
                        r.sim.kv_publisher.publish([])
                        r.engine.reset_prefix_cache()
                    await asyncio.sleep(0.05)
            yield replicas, gw


def arrived(engine: Engine) -> int:
    """Requests that reached ``engine``: queued, running or ended."""
    stats = engine.stats
    return (len(engine.waiting) + len(engine.running) + stats.requests_succeeded
            + stats.requests_aborted)


def chat(text: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}


async def test_a_burst_follows_the_first_pick_before_any_event_arrives() -> None:
    async with precise_fleet(4) as (_, gw), httpx.AsyncClient(timeout=20) as client:
        prompt = chat("shared system prompt for the burst " * 60)
        replies = await asyncio.gather(
            *(client.post(gw.url + "/v1/chat/completions", json=prompt) for _ in range(6))
        )
        assert {r.status_code for r in replies} == {200}
        assert len({r.headers["x-gateway-destination-endpoint"] for r in replies}) == 1


async def test_routes_by_the_real_cache_after_eviction() -> None:
    ttl = 0.2
    async with precise_fleet(2, ttl, num_gpu_blocks=64) as (replicas, gw), httpx.AsyncClient(
        timeout=20
    ) as client:
        history = "the long history of conversation x " * 40  # ~ 20 blocks
        first = await client.post(gw.url + "/v1/chat/completions", json=chat(history))
        home = first.headers["x-gateway-destination-endpoint"]
        other = next(r for r in replicas if eid(r) != home)
        home_rep = next(r for r in replicas if eid(r) == home)
        # Behind the gateway's back: the home replica evicts the history under pressure and
        # the other replica computes it.
        for i in range(6):
            filler = chat(f"unrelated filler number {i} " * 40)
            await client.post(home_rep.url + "/v1/chat/completions", json=filler)
        await client.post(other.url + "/v1/chat/completions", json=chat(history))
        precise = gw.gateway.precise
        assert precise is not None
        await wait_for(lambda: all(
            precise.index.engine_hashes(eid(r)) == set(r.engine.kv.cached_hashes())
            for r in replicas
        ))
        await asyncio.sleep(ttl)  # the first pick's speculative entries have expired
        router = gw.gateway.router
        body = orjson.dumps(chat(history))
        probe = router.routing_request(parse_request("chat", body), {}, "probe")
        await router.rank(probe)
        # The approximate index still places the history at home; the queue a request joins
        # and the calibrator count what the replica will really compute.
        tokens = probe.prompt_tokens
        assert probe.uncached_tokens(home) < tokens / 4 < probe.uncached_tokens(eid(other))
        assert router.uncached_tokens(probe, home) > tokens * 3 / 4
        assert router.uncached_tokens(probe, eid(other)) < tokens / 4
        again = await client.post(gw.url + "/v1/chat/completions", json=chat(history))
        assert again.headers["x-gateway-destination-endpoint"] == eid(other)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_prediction_error_for_both_indexes() -> None:
    async with precise_fleet(2) as (replicas, gw), httpx.AsyncClient(timeout=20) as client:
        gateway = gw.gateway
        prediction = gateway.prediction
        precise_index = gateway.precise.index if gateway.precise is not None else None
        assert prediction is not None and precise_index is not None
        text = "a conversation that grows turn by turn " * 20
        for turn in range(4):
            body = orjson.dumps(chat(text))
            parsed = parse_request("chat", body)
            routing = gateway.router.routing_request(parsed, {}, f"req-{turn}")
            ranked = await gateway.router.rank(routing)
            gateway.router.picked(routing, ranked[0].id)
            reply = await client.post(ranked[0].url + "/v1/chat/completions", content=body)
            usage = find_usage(reply.content)
            prediction.observe(ranked[0].id, routing, usage)
            answer = reply.json()["choices"][0]["message"]["content"]
            text += answer + " and then the user says more words " * 5
            # The think gap: the turn's events arrive before the next turn (waited for, as a
            # fixed gap was too short on a loaded machine).
            await wait_for(lambda: all(
                precise_index.engine_hashes(eid(r)) == set(r.engine.kv.cached_hashes())
                for r in replicas
            ))
        precise = prediction.summary["precise"]
        assert precise.count == 4
        assert precise.within_one_block == 4
        assert prediction.summary["approximate"].count == 4
        metrics = gateway.metrics.render().decode()
        assert 'prefixgate_prefix_prediction_within_one_block_ratio{mode="precise"} 1.0' in metrics


async def test_a_burst_is_predicted_from_the_picks_in_flight() -> None:
    """Siblings sent one after another hit what the first is computing (vLLM caches a block
    when the step computing it is scheduled): ``precise`` counts the picks in flight and is
    right; ``precise_confirmed`` (events and finished prefills) under-predicts them."""
    async with precise_fleet(2) as (replicas, gw), httpx.AsyncClient(timeout=20) as client:
        gateway = gw.gateway
        prediction = gateway.prediction
        assert prediction is not None
        shared = "the shared context of a burst of sub-agents " * 30
        picks = []
        for i in range(4):  # picked at once, as a burst is, before anything reaches a replica
            body = orjson.dumps(chat(shared + f" and the task of sub-agent number {i}"))
            routing = gateway.router.routing_request(
                parse_request("chat", body), {}, f"burst-{i}"
            )
            ranked = await gateway.router.rank(routing)
            gateway.router.picked(routing, ranked[0].id)
            picks.append((routing, ranked[0], body))
        sends = []
        for n, (routing, endpoint, body) in enumerate(picks, 1):
            url = endpoint.url + "/v1/chat/completions"
            task = asyncio.create_task(client.post(url, content=body))
            sends.append((routing, endpoint.id, task))
            # Arrive in pick order: each reaches its replica before the next is sent.
            await wait_for(lambda n=n: sum(arrived(r.engine) for r in replicas) >= n)  # type: ignore[misc]
        assert len({endpoint for _, endpoint, _ in sends}) == 1
        for routing, endpoint, task in sends:
            reply = await task
            prediction.observe(endpoint, routing, find_usage(reply.content))
        cached = [(await t).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for _, _, t in sends]
        assert cached[0] == 0 and min(cached[1:]) > 200
        assert prediction.summary["precise"].within_one_block == 4
        assert prediction.summary["precise_confirmed"].under == 3


def test_find_usage_in_json_and_sse() -> None:
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert find_usage(orjson.dumps({"usage": usage})) == usage
    sse = b'data: {"choices":[{"delta":{}}]}\n\ndata: {"choices":[],"usage":' + orjson.dumps(
        usage) + b"}\n\ndata: [DONE]\n\n"
    assert find_usage(sse) == usage
    assert find_usage(b"data: [DONE]\n\n") is None


def test_prediction_without_usage_or_precise_state() -> None:
    tracker = PredictionTracker(CollectorRegistry(), block_size=16)
    routing = RoutingRequest("r", MODEL, prompt_bytes=1000, block_bytes=256,
                             block_hashes=[1, 2, 3], prefix_hits={"a": 2})
    tracker.observe("a", routing, None)
    assert tracker.summary["approximate"].count == 0
    assert tracker.skips == {"no_usage": 1}
    usage = {"prompt_tokens": 250, "prompt_tokens_details": {"cached_tokens": 128}}
    tracker.observe("a", routing, usage)
    # 2 of 3.9 blocks' worth of bytes -> 51% of 250 tokens = 128 -> exactly right.
    assert tracker.summary["approximate"].within_one_block == 1


def test_precise_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        parse_config({"precisePrefix": {"tokenizer": {"type": "huggingface"}}})
    with pytest.raises(ConfigError, match="port"):
        parse_config({"precisePrefix": {"kvEvents": {"port": 5557, "portOffset": 1}}})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({"precisePrefix": {"kvEvent": {}}})


def test_precise_strategy_turns_precise_routing_on() -> None:
    pool = {"endpoints": [{"url": "http://127.0.0.1:9"}]}
    precise = build_gateway(parse_config({"pool": pool, "strategy": "precise"}))
    assert precise.precise is not None and isinstance(precise.router, PreciseRouter)
    plain = build_gateway(parse_config({"pool": pool}))
    assert plain.precise is None and plain.prediction is not None
    forced = build_gateway(parse_config({"pool": pool, "precisePrefix": {"enabled": True}}))
    assert forced.precise is not None
