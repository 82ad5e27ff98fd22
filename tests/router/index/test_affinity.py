from __future__ import annotations

from router.index.affinity import InMemoryAffinityStore
from tests.manual_clock import ManualClock


async def test_ttl_and_lru_bound() -> None:
    clock = ManualClock()
    store = InMemoryAffinityStore(ttl_seconds=10, max_sessions=2, clock=clock)
    store.set("s1", "a")
    assert await store.get("s1") == "a"
    clock.now = 11
    assert await store.get("s1") is None
    store.set("s1", "a")
    store.set("s2", "b")
    store.set("s3", "c")
    assert len(store) == 2
    assert await store.get("s1") is None
    await store.forget_endpoint("b")
    assert await store.get("s2") is None
    assert await store.get("s3") == "c"
