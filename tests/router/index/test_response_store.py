"""Which endpoint stores each response (Responses API): the local map's bound."""

from __future__ import annotations

from router.index.response_store import ResponseRoutes


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
