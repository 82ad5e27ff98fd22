"""Token-true index sizing end to end: simulated replicas whose tokenizer covers 3 or 9 bytes a
token, a gateway in front, real loopback sockets. The gateway learns the ratio from the answers'
usage (streamed and not), and its index then keeps what a replica's KV cache keeps."""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import orjson
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import endpoint_id_from_url
from router.core.hashing import block_hashes
from router.protocol.parsing import parse_request
from router.serve.server import RunningGateway, running_gateway
from tests.gateways import MODEL, gateway_config

WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "tau", "phi", "rho")


def _text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS) + str(rng.randint(0, 999)))
    return " ".join(words)


def _body(content: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}],
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _ask(http: aiohttp.ClientSession, gw: RunningGateway, body: dict[str, Any]) -> Any:
    """The answer's usage (the last chunk's, when streamed)."""
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.read()
    if not body.get("stream"):
        return orjson.loads(data)["usage"]
    events = [line[5:] for line in data.split(b"\n") if line.startswith(b"data: {")]
    return orjson.loads(events[-1])["usage"]


@pytest.mark.parametrize("density", [3.0, 9.0])
async def test_the_gateway_learns_the_replicas_bytes_per_token(density: float) -> None:
    rng = random.Random(int(density))
    sim = SimConfig(zero_latency=True, bytes_per_token=density)
    async with start_replicas(2, sim) as reps:
        config = gateway_config([r.url for r in reps])
        async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
            for i in range(24):
                await _ask(http, gw, _body(_text(rng, rng.randint(1000, 6000)), i % 2 == 1))
            learned = gw.gateway.sizer.density.ratio(MODEL)
            assert learned == pytest.approx(density, rel=0.05)
            # The cost model's token estimate of a prompt follows the learned ratio.
            body = _body(_text(rng, 5000))
            parsed = parse_request("chat", orjson.dumps(body))
            estimate = gw.gateway.router.routing_request(parsed, {}, "r").prompt_tokens
            actual = (await _ask(http, gw, body))["prompt_tokens"]
            assert estimate == pytest.approx(actual, rel=0.05)
            for r in reps:  # each index sized at the learned ratio from the replica's KV
                kv_tokens = sim.num_gpu_blocks * sim.block_size
                want = int(kv_tokens * learned // config.prefix_index.block_bytes)
                got = gw.gateway.sizer.capacity_blocks(endpoint_id_from_url(r.url))
                assert got is not None and abs(got - want) <= want * 0.1


async def test_the_index_keeps_the_prefixes_a_replica_still_caches_at_9_bytes_a_token() -> None:
    """At 9 bytes a token a replica holds more than twice the text a 4-bytes-a-token index
    would allow: the oldest prefixes, still cached there, used to be forgotten by the index."""
    rng = random.Random(9)
    # 4,096 tokens of KV: ~36 KB of text at 9 bytes a token (64 index blocks at 4).
    sim = SimConfig(zero_latency=True, bytes_per_token=9.0, num_gpu_blocks=256, block_size=16)
    async with start_replicas(1, sim) as reps:
        config = gateway_config([reps[0].url])
        eid = endpoint_id_from_url(reps[0].url)
        async with running_gateway(config) as gw, aiohttp.ClientSession() as http:
            for i in range(10):  # short answers teach the ratio
                await _ask(http, gw, _body(_text(rng, 400), i % 2 == 0))
            prompts = [_text(rng, 4500) for _ in range(6)]  # ~27 KB, ~3,000 tokens
            for prompt in prompts:
                await _ask(http, gw, _body(prompt))
            index, block_bytes = gw.gateway.stores.index, config.prefix_index.block_bytes
            indexed = []
            for prompt in prompts:
                rendered = parse_request("chat", orjson.dumps(_body(prompt))).rendered
                hashes = block_hashes(rendered, block_bytes, MODEL)
                matched = (await index.match(hashes, [eid])).get(eid, 0)
                indexed.append(matched / len(hashes))
            # Ground truth after the index was read: the replica still caches each prompt.
            cached = []
            for prompt in prompts:
                usage = await _ask(http, gw, _body(prompt))
                held = usage["prompt_tokens_details"]["cached_tokens"]
                cached.append(held / usage["prompt_tokens"])
    assert min(cached) > 0.9
    assert min(indexed) > 0.9, indexed


def _agent_body(api: str, content: str) -> dict[str, Any]:
    """A streamed request of ``api`` whose client asked for no usage."""
    if api == "responses":
        return {"model": MODEL, "max_output_tokens": 2, "stream": True, "input": content}
    return {
        "model": MODEL, "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": content}],
    }


@pytest.mark.parametrize(
    ("api", "path"),
    [("chat", "/v1/chat/completions"), ("messages", "/v1/messages"),
     ("responses", "/v1/responses")],
)
async def test_streams_whose_clients_ask_no_usage_teach_the_ratio(api: str, path: str) -> None:
    """Chat streams without stream_options.include_usage carry no usage (the gateway asks the
    replica's /tokenize); a Messages stream counts its prompt in its first event, a Responses
    stream in its last (usage nested in the event)."""
    rng = random.Random(7)
    sim = SimConfig(zero_latency=True, bytes_per_token=9.0)
    async with (
        start_replicas(1, sim) as reps, running_gateway(gateway_config([reps[0].url])) as gw,
        aiohttp.ClientSession() as http,
    ):
        density = gw.gateway.sizer.density
        for _ in range(40):  # 8 samples teach it; a count in flight skips a prompt
            body = _agent_body(api, _text(rng, rng.randint(1000, 4000)))
            async with http.post(gw.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            await gw.gateway.token_counts.settle()
            if density.samples(MODEL) >= 8:
                break
        assert density.ratio(MODEL) == pytest.approx(9.0, rel=0.05)
