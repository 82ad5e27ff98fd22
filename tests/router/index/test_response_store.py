"""Which endpoint stores each response (Responses API): the local map's bound, asking the
endpoints, and the 4xx when none can take a follow-up."""

from __future__ import annotations

import asyncio

import pytest

from router.core.endpoints import Endpoint, EndpointSnapshot
from router.core.errors import BadRequestError, ResponseNotFoundError, ResponseUnavailableError
from router.core.pool import EndpointPool
from router.index.response_store import MISS_TTL_S, ResponseRoutes
from tests.manual_clock import ManualClock
from tests.snapshots import snap


async def test_ids_read_from_redis_are_kept_within_the_bound(
    redis_url: str, redis_namespace: str
) -> None:
    storing = ResponseRoutes(url=redis_url, namespace=redis_namespace, timeout_ms=2000)
    reading = ResponseRoutes(
        max_entries=2, url=redis_url, namespace=redis_namespace, timeout_ms=2000
    )
    try:
        for i in range(10):
            storing.remember(f"resp_{i}", "e1")
        await storing.flush()
        for i in range(10):
            assert await reading.endpoint_of(f"resp_{i}") == "e1"
        assert len(reading) == 2, "a gateway resolving others' ids keeps only the newest"
        assert reading.local("resp_9") == "e1" and reading.local("resp_0") is None
    finally:
        await storing.aclose()
        await reading.aclose()


class Probes:
    """Endpoints asked whether they hold an id: ``holds`` do, ``silent`` never answer,
    ``failing`` answer with an error (None), the others say they do not (a 404)."""

    def __init__(
        self, holds: set[str] = frozenset(), silent: set[str] = frozenset(),
        failing: set[str] = frozenset(),
    ) -> None:
        self.holds, self.silent, self.failing = holds, silent, failing
        self.asked: list[str] = []

    async def __call__(self, endpoint: EndpointSnapshot, response_id: str) -> bool | None:
        self.asked.append(endpoint.id)
        if endpoint.id in self.silent:
            await asyncio.Event().wait()
        if endpoint.id in self.failing:
            return None
        return endpoint.id in self.holds


def pool_of(*ids: str, models: set[str] | None = None) -> EndpointPool:
    pool = EndpointPool(Endpoint.from_url(f"http://{eid}") for eid in ids)
    for state in pool:
        state.healthy, state.models = True, set(models or {"m"})
    return pool


async def test_an_id_no_endpoint_holds_is_not_asked_for_again_at_once() -> None:
    clock, probes = ManualClock(), Probes()
    routes = ResponseRoutes(probe=probes, clock=clock)
    pool = pool_of("a:1", "b:1")
    candidates = [snap("a:1"), snap("b:1")]
    for _ in range(3):
        with pytest.raises(ResponseNotFoundError):
            await routes.resolve("resp_gone", pool, candidates)
    assert sorted(probes.asked) == ["a:1", "b:1"], "asked once, then answered from memory"
    clock.now += MISS_TTL_S + 1
    with pytest.raises(ResponseNotFoundError):
        await routes.resolve("resp_gone", pool, candidates)
    assert len(probes.asked) == 4


async def test_an_id_an_endpoint_did_not_answer_for_is_asked_for_again() -> None:
    probes = Probes(silent={"b:1"})
    routes = ResponseRoutes(probe=probes, probe_timeout_seconds=0.01)
    pool = pool_of("a:1", "b:1")
    for _ in range(2):
        with pytest.raises(ResponseNotFoundError):
            await routes.resolve("resp_maybe", pool, [snap("a:1"), snap("b:1")])
    assert len(probes.asked) == 4, "b might hold it: not a miss to remember"


async def test_a_miss_is_not_remembered_when_an_endpoint_failed_to_answer() -> None:
    """An endpoint that erred (a refused connection, a 503) may hold it."""
    probes = Probes(failing={"b:1"})
    routes = ResponseRoutes(probe=probes)
    pool = pool_of("a:1", "b:1")
    for _ in range(2):
        with pytest.raises(ResponseNotFoundError):
            await routes.resolve("resp_maybe", pool, [snap("a:1"), snap("b:1")])
    assert probes.asked == ["a:1", "b:1"] * 2


async def test_a_miss_covers_only_the_endpoints_that_said_so() -> None:
    """Asked of one endpoint (the others serve another model, or were ejected), a miss says
    nothing of the others: a request that may go to them asks them."""
    probes = Probes()
    routes = ResponseRoutes(probe=probes)
    pool = pool_of("a:1", "b:1")
    for _ in range(2):
        with pytest.raises(ResponseNotFoundError):
            await routes.resolve("resp_maybe", pool, [snap("a:1")])
    with pytest.raises(ResponseNotFoundError):
        await routes.resolve("resp_maybe", pool, [snap("a:1"), snap("b:1")])
    assert probes.asked == ["a:1", "a:1", "b:1"]


async def test_a_follow_up_for_another_model_than_its_holders_is_a_400_not_a_409() -> None:
    """Retrying cannot help: the holder does not serve the model asked for."""
    routes = ResponseRoutes()
    routes.remember("resp_1", "a:1")
    pool = pool_of("a:1", "b:1", models={"other"})
    with pytest.raises(BadRequestError, match="does not serve model 'm'"):
        await routes.resolve("resp_1", pool, [snap("b:1")], model="m")
    with pytest.raises(ResponseUnavailableError):  # serves it, but cannot take it now
        await routes.resolve("resp_1", pool, [snap("b:1")], model="other")
