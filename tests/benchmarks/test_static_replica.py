"""The static replica speaks what the gateway reads, and a gateway routes through it."""

from __future__ import annotations

import asyncio

import httpx

from benchmarks.static_replica import start
from router.api.usage_tap import find_usage
from router.pool.engine_pages import parse_vllm_metrics
from router.serve.server import running_gateway
from tests.gateways import gateway_config


async def test_it_answers_the_monitor_and_both_completion_routes_streamed_or_not() -> None:
    server = await start(0, "m", tokens=3)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "m"
            metrics = parse_vllm_metrics((await http.get("/metrics")).text, 0.0)
            assert (metrics.running, metrics.waiting, metrics.num_gpu_blocks) == (0, 0, 100000)
            chat = await http.post("/v1/chat/completions", json={"model": "m", "messages": []})
            assert chat.json()["choices"][0]["message"]["content"] == "ok ok ok "
            streamed = await http.post("/v1/completions", json={"prompt": "p", "stream": True})
            assert streamed.headers["content-type"] == "text/event-stream"
            assert streamed.text.count("data: ") == 5 and streamed.text.endswith("[DONE]\n\n")
            assert find_usage(streamed.content) == find_usage(chat.content)
            assert (await http.post("/v1/embeddings", json={})).status_code == 404
    finally:
        server.close()
        await server.wait_closed()


async def test_a_gateway_in_front_of_it_answers() -> None:
    server = await start(0, "sim-model")
    port = server.sockets[0].getsockname()[1]
    try:
        config = gateway_config([f"http://127.0.0.1:{port}"], server={"port": 0})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
            for stream in (False, True):
                reply = await asyncio.wait_for(
                    http.post("/v1/chat/completions", json={**body, "stream": stream}), 10
                )
                assert reply.status_code == 200 and b'"usage"' in reply.content
    finally:
        server.close()
        await server.wait_closed()
