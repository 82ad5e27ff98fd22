"""SLO-aware admission: a sheddable request no endpoint can answer in time is rejected at once."""

from __future__ import annotations

import httpx
import orjson
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.config.model import parse_config
from router.core.errors import DROPPED_REASON_HEADER
from router.estimators.ttft_errors import MIN_SAMPLES, PredictionErrors
from router.serve.server import running_gateway

pytestmark = pytest.mark.slow

SLO = "x-llm-d-slo-ttft-ms"
OBJECTIVE = "x-gateway-inference-objective"


async def test_sheddable_requests_that_would_miss_their_ttft_target_are_rejected() -> None:
    async with start_replicas(1, SimConfig(speed=20.0)) as replicas:
        config = parse_config(
            {
                "server": {"port": 0},
                "pool": {"endpoints": [{"url": r.url} for r in replicas]},
                "flowControl": {
                    "objectives": [
                        {"name": "batch", "priority": -1},
                        {"name": "tight", "priority": -1, "ttftSloMs": 0.001},
                    ]
                },
            }
        )
        body = {"model": "sim-model", "prompt": "hello " * 200, "max_tokens": 2}
        async with running_gateway(config) as gw, httpx.AsyncClient(timeout=60) as http:
            url = f"{gw.url}/v1/completions"

            async def post(headers: dict[str, str]) -> httpx.Response:
                return await http.post(url, json=body, headers=headers)

            # Until the gateway has seen how its predictions fare, nothing is rejected on one.
            early = await post({OBJECTIVE: "batch", SLO: "0.001"})
            assert early.status_code == 200
            for _ in range(MIN_SAMPLES):
                streamed = await http.post(url, json={**body, "stream": True})
                assert streamed.status_code == 200
            # The predicted TTFT for 200 words, even discounted, is far above 1 us.
            shed = await post({OBJECTIVE: "batch", SLO: "0.001"})
            assert shed.status_code == 429
            assert shed.headers[DROPPED_REASON_HEADER] == "rejected-slo"
            assert "exceeds the request's target" in orjson.loads(shed.content)["error"]["message"]
            by_objective = await post({OBJECTIVE: "tight"})
            assert by_objective.headers.get(DROPPED_REASON_HEADER) == "rejected-slo"
            # Not sheddable: served however late it is predicted to be.
            assert (await post({SLO: "0.001"})).status_code == 200
            # A reachable target: served.
            assert (await post({OBJECTIVE: "batch", SLO: "600000"})).status_code == 200
            for bad in ("soon", "-5", "0", "nan"):
                answer = await post({SLO: bad})
                assert answer.status_code == 400, bad
                assert SLO in orjson.loads(answer.content)["error"]["message"]
            registry = gw.gateway.metrics.registry
            rejected = {"reason": "slo"}
            assert registry.get_sample_value("prefixgate_flow_rejections_total", rejected) == 2
            assert gw.gateway.flow.outstanding("sim-model") == 0, "rejected tickets released"


def test_prediction_errors_give_the_low_quantile_once_enough_are_known() -> None:
    errors = PredictionErrors(window=100, quantile=0.1)
    for _ in range(MIN_SAMPLES - 1):
        errors.record(2.0, 1.0)
    assert errors.optimistic_ratio() is None
    errors.record(2.0, 1.0)
    assert errors.optimistic_ratio() == 0.5
    for i in range(100):
        errors.record(1.0, 1.0 + i / 100)  # the window forgets the old ratios
    assert errors.optimistic_ratio() == pytest.approx(1.09)
    errors.record(0.0, 1.0)  # a zero prediction is no evidence
    errors.record(1.0, float("nan"))
    assert errors.optimistic_ratio() == pytest.approx(1.09)
