"""Replicas whose metrics read saturated while they are idle still get every request at once.

A vLLM replica with long agent contexts reads high KV use in normal operation, and a stuck
exporter can report a queue that is not there: neither may hold the gateway's requests.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.config.model import parse_config
from router.serve.server import running_gateway

pytestmark = pytest.mark.slow

SATURATED = (
    b'vllm:num_requests_waiting{model_name="sim-model"} 8\n'
    b'vllm:num_requests_running{model_name="sim-model"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="sim-model"} 0.99\n'
)


async def test_saturated_metrics_on_idle_replicas_do_not_hold_requests() -> None:
    async with start_replicas(2, SimConfig(speed=20.0)) as replicas:
        for replica in replicas:
            replica.sim.metrics.render = lambda: SATURATED  # type: ignore[method-assign]
        config = parse_config(
            {
                "server": {"port": 0},
                "pool": {
                    "endpoints": [{"url": r.url} for r in replicas],
                    "metricsScrape": {"intervalSeconds": 0.02},
                },
                # A TTL far beyond the test's own bound: a held request would fail the test
                # by timing out, not by a 429 that could pass for something else.
                "flowControl": {"defaultRequestTTL": 600},
            }
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(timeout=60) as http:
            gateway = gw.gateway
            async with asyncio.timeout(30):
                while not all(s.metrics.scraped_at for s in gateway.pool):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # the monitor's scrape lands
            assert all(s.metrics.kv_usage == 0.99 for s in gateway.pool)
            body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 2}
            url = f"{gw.url}/v1/completions"
            async with asyncio.timeout(30):
                for _ in range(4):
                    assert (await http.post(url, json=body)).status_code == 200
                burst = await asyncio.gather(*(http.post(url, json=body) for _ in range(8)))
            assert all(r.status_code == 200 for r in burst)
            registry = gateway.metrics.registry
            fast = registry.get_sample_value(
                "prefixgate_flow_dispatches_total", {"band": "default", "path": "fast"}
            )
            assert fast == 12, "every request passed at once, none waited in the queues"
            assert gateway.flow.queued == 0
