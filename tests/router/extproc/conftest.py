"""Fixtures of the ext_proc tests: two simulated replicas, the picker, and Envoy's part."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.extproc.server import RunningEpp, running_epp
from tests.router.extproc.envoy import (
    Envoy,
    epp_config,
)


@pytest.fixture
async def two_replicas() -> AsyncIterator[list[Replica]]:
    async with start_replicas(2, SimConfig(speed=20.0)) as reps:
        yield reps


@pytest.fixture
async def epp(two_replicas: list[Replica]) -> AsyncIterator[RunningEpp]:
    async with running_epp(epp_config(two_replicas, flowControl={})) as running:
        yield running


@pytest.fixture
async def envoy(epp: RunningEpp) -> AsyncIterator[Envoy]:
    async with grpc.aio.insecure_channel(epp.target) as channel:
        yield Envoy(channel)
