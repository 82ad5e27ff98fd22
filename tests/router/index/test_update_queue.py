"""The bounded queue of Redis updates (router/index/update_queue.py): what it drops and what
it must not."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.index.redis_link import RedisLink, RedisMetrics, Unavailable
from router.index.update_queue import UpdateQueue


async def test_updates_to_keep_are_neither_pushed_out_nor_dropped(redis_url: str) -> None:
    link = RedisLink(redis_url, component="test", metrics=RedisMetrics(CollectorRegistry()))
    shipped: list[list[str]] = []
    failures = 1

    async def ship(batch: list[tuple[str, int]]) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise Unavailable("timeout")
        shipped.append([k for k, _ in batch])

    queue: UpdateQueue[str, int] = UpdateQueue(
        ship, op="test", link=link, max_items=2, keep=lambda k: k.startswith("forget")
    )
    try:
        queue.put("forget a", 0)
        for n in range(4):  # newer records push out older records, never the purge
            queue.put(f"record {n}", 0)
        await queue.flush()
    finally:
        await queue.aclose(1.0)
        await link.aclose()
    # Two records were pushed out by newer ones; the first batch (the purge and the newest
    # records) met a Redis failure: its records were dropped, the purge went again.
    assert shipped == [["forget a"]]


async def test_an_update_put_again_keeps_the_cost_accounting_exact(redis_url: str) -> None:
    """A key put again replaces its pending update: its cost is counted once, whatever its
    value (None is one: ResponseRoutes queues a deleted response's id with None)."""
    link = RedisLink(redis_url, component="test", metrics=RedisMetrics(CollectorRegistry()))

    async def ship(batch: list[tuple[str, str | None]]) -> None:
        return None

    queue: UpdateQueue[str, str | None] = UpdateQueue(ship, op="test", link=link, max_cost=2)
    try:
        for _ in range(3):  # a response deleted three times before the queue ran
            queue.put("resp_1", None)
        queue.put("resp_2", "e1")
        assert queue._total_cost == 2
        assert "resp_1" in queue and "resp_2" in queue, "two updates fit a cost of 2"
    finally:
        await queue.aclose(1.0)
        await link.aclose()
