"""The simulated server over real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.tokenizer import Tokenizer

FAST = SimConfig(speed=50, max_model_len=40_000)
SLOW = SimConfig(speed=1, itl_ms=20)


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    async with start_replicas(1, FAST) as replicas:
        yield replicas[0]


@pytest.fixture
async def client(replica: Replica) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=replica.url, timeout=10) as c:
        yield c


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list[Any]:
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def wait_for(predicate: Any) -> None:
    """Poll engine state from outside (it has no event for "running dropped"), bounded."""
    async with asyncio.timeout(5):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_chat_non_stream_shape_and_cached_tokens(client: httpx.AsyncClient) -> None:
    body = chat_body("tell me a story " * 50, max_tokens=7)
    first = (await client.post("/v1/chat/completions", json=body)).json()
    assert first["id"].startswith("chatcmpl-") and first["object"] == "chat.completion"
    choice = first["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    prompt_len = len(Tokenizer().encode_chat(body["messages"]))
    assert first["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 7,
        "total_tokens": prompt_len + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    second = (await client.post("/v1/chat/completions", json=body)).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_len - 1) // 16 * 16
    assert second["choices"][0]["message"]["content"] == choice["message"]["content"]
    seeded = (await client.post("/v1/chat/completions", json={**body, "seed": 5})).json()
    assert seeded["choices"][0]["message"]["content"] != choice["message"]["content"]


async def test_next_turn_hits_generated_blocks(client: httpx.AsyncClient) -> None:
    tok = Tokenizer()
    messages = [{"role": "user", "content": "plan the trip " * 40}]
    r1 = (
        await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 50})
    ).json()
    reply = r1["choices"][0]["message"]["content"]
    p1, out = r1["usage"]["prompt_tokens"], r1["usage"]["completion_tokens"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    r2 = (
        await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
    ).json()
    p2 = len(tok.encode_chat(messages))
    expected = min((p1 + out - 1) // 16, (p2 - 1) // 16) * 16
    assert expected > (p1 // 16) * 16  # generated tokens' blocks are part of the hit
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == expected


async def test_completions_stream_with_usage(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6}
    full = (await client.post("/v1/completions", json=body)).json()
    assert full["id"].startswith("cmpl-") and full["object"] == "text_completion"
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/completions", json=stream_body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    usage_chunk, tokens = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert len(tokens) == 6
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 5 + ["length"]
    assert "".join(e["choices"][0]["text"] for e in tokens) == full["choices"][0]["text"]
    ids = {e["id"] for e in tokens}
    assert len(ids) == 1


async def test_chat_stream_role_chunk_and_no_usage_by_default(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/chat/completions", json=chat_body("hi", max_tokens=3, stream=True)
    )
    events = sse_events(resp.text)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(events) == 1 + 3 + 1 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", orjson.dumps({"model": "sim-model"}), 400, "messages"),
        ("/v1/completions", orjson.dumps({"max_tokens": 3}), 400, "prompt"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "model": "gpt-9"}), 404, "model"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": "a"}), 400, "max_tokens"),
        ("/v1/completions", orjson.dumps({"prompt": [1, -5]}), 400, "prompt"),
        ("/v1/completions", orjson.dumps({"prompt": "word " * 50_000}), 400, "prompt"),
        ("/v1/chat/completions", orjson.dumps({"messages": [{"content": "x"}]}), 400, "messages"),
        ("/v1/chat/completions", orjson.dumps({"messages": [1]}), 400, "messages"),
    ],
)
async def test_error_shapes(
    client: httpx.AsyncClient, path: str, body: bytes, status: int, param: str | None
) -> None:
    resp = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_metrics_and_info_endpoints(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert f"\n{name}{{" in text, name
    assert 'block_size="16"' in text and 'num_gpu_blocks="8192"' in text
    assert 'model_name="sim-model"' in text
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/version")).json()["version"]
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "sim-model"
    for path in (
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/v1/loads",
        "/sim/state",
    ):
        assert (await client.get(path)).status_code == 200, path
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    assert (await client.get("/sim/state")).json()["cached_blocks"] == 0


async def test_tokenize_detokenize_and_render(client: httpx.AsyncClient) -> None:
    tok = Tokenizer()
    resp = (await client.post("/tokenize", json={"prompt": "hello there"})).json()
    assert resp == {
        "count": len(tok.encode("hello there")),
        "max_model_len": 40_000,
        "tokens": tok.encode("hello there"),
        "token_strs": None,
    }
    messages = [{"role": "user", "content": "hi"}]
    chat = (await client.post("/tokenize", json={"messages": messages})).json()
    assert chat["tokens"] == tok.encode_chat(messages)
    detok = (await client.post("/detokenize", json={"tokens": resp["tokens"]})).json()
    assert detok == {"prompt": "hello there"}
    render = await client.post("/v1/chat/completions/render", json={"messages": messages})
    assert render.json()["token_ids"] == chat["tokens"]
    crender = await client.post("/v1/completions/render", json={"prompt": "hello there"})
    assert crender.json()[0]["token_ids"] == resp["tokens"]


async def test_client_disconnect_mid_stream_aborts() -> None:
    async with start_replicas(1, SLOW) as (replica,):
        async with httpx.AsyncClient(base_url=replica.url, timeout=10) as c:
            body = chat_body("long answer please", max_tokens=5000, stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break
                assert replica.engine.state()["running"] == 1
        await wait_for(lambda: replica.engine.state()["running"] == 0)
        assert replica.engine.kv.usage == 0.0
        assert replica.engine.stats.requests_aborted == 1


async def test_client_disconnect_before_first_token_aborts_non_stream() -> None:
    cfg = SimConfig(speed=1, prefill_ms_per_token=1.0)  # 10 s of prefill
    async with start_replicas(1, cfg) as (replica,):
        async with httpx.AsyncClient(base_url=replica.url, timeout=0.3) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(
                    "/v1/completions", json={"prompt": list(range(10_000)), "max_tokens": 5}
                )
        await wait_for(lambda: replica.engine.state()["running"] == 0)
        assert replica.engine.stats.requests_aborted == 1


async def test_kv_transfer_round_trip() -> None:
    async with start_replicas(2, FAST) as (prefill, decode):
        prompt = list(range(1, 4001))
        async with httpx.AsyncClient(timeout=10) as c:
            kv_req = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            first = (
                await c.post(
                    f"{prefill.url}/v1/completions",
                    json={
                        "prompt": prompt,
                        "max_tokens": 1,
                        "stream": False,
                        "kv_transfer_params": kv_req,
                    },
                )
            ).json()
            params = first["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_port"] == prefill.port and params["remote_host"] == "127.0.0.1"
            assert params["remote_engine_id"] == prefill.engine.engine_id
            assert params["tp_size"] == 1 and len(params["remote_block_ids"]) == 250
            assert first["usage"]["completion_tokens"] == 1
            second = (
                await c.post(
                    f"{decode.url}/v1/completions",
                    json={"prompt": prompt, "max_tokens": 10, "kv_transfer_params": params},
                )
            ).json()
            assert second["usage"]["completion_tokens"] == 10
    ttft_prefill = _ttft_sum(prefill)
    ttft_decode = _ttft_sum(decode)
    assert ttft_prefill == pytest.approx(0.030 + 4000 * 0.0002, abs=0.02)
    assert ttft_decode < 0.2
    assert decode.engine.kv.num_cached_blocks >= 249


def _ttft_sum(replica: Replica) -> float:
    value = replica.sim.metrics.registry.get_sample_value(
        "vllm:time_to_first_token_seconds_sum", {"model_name": "sim-model"}
    )
    assert value is not None
    return value


async def test_faults(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert (
        await client.post("/sim/faults", json={"fail_rate": 1, "status": 503})
    ).status_code == 200
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    assert (await client.get("/health")).status_code == 200
    await client.post("/sim/faults", json={"hang": True})
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json=body, timeout=0.2)
    assert (await client.post("/sim/faults", json={"fail_rate": 7})).status_code == 400
    await client.delete("/sim/faults")
    assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_zero_latency_server_and_served_names() -> None:
    cfg = SimConfig(zero_latency=True, served_model_names=("a", "b"))
    async with (
        start_replicas(1, cfg) as (replica,),
        httpx.AsyncClient(base_url=replica.url, timeout=10) as c,
    ):
        for model in ("a", "b"):
            r = await c.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "q"}]},
            )
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 64
        stream = await c.post(
            "/v1/completions",
            json={"model": "a", "prompt": "p", "max_tokens": 3, "stream": True},
        )
        assert len(sse_events(stream.text)) == 4
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["a", "b"]
