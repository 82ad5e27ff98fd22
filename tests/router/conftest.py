"""Fixtures for gateway tests: simulated replicas and a gateway, on real loopback sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.config import parse_config
from router.server import RunningGateway, running_gateway

MODEL = "sim-model"


def gateway_config(urls: list[str], **overrides: Any) -> Any:
    data: dict[str, Any] = {
        "server": {"port": 0},
        "pool": {
            "endpoints": [{"url": u} for u in urls],
            "healthCheck": {"intervalSeconds": 0.2, "unhealthyThreshold": 2},
            "metricsScrape": {"intervalSeconds": 0.05},
        },
        "seed": 1,
    }
    data.update(overrides)
    return parse_config(data)


@pytest.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    async with start_replicas(4, SimConfig(speed=20.0)) as reps:
        yield reps


@pytest.fixture
async def gateway(replicas: list[Replica]) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gateway_config([r.url for r in replicas])) as gw:
        yield gw
