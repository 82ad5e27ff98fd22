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


async def test_a_restore_takes_a_failed_pick_back_to_the_previous_endpoint_or_to_none() -> None:
    # Failover: every attempt of the session's request failed, so the pick (set before the
    # first attempt) is undone (router/scheduling/producers.py AffinityTracker.on_unpick).
    store = InMemoryAffinityStore(ttl_seconds=10, max_sessions=10, clock=ManualClock())
    store.set("s1", "a")
    store.set("s1", "failed")
    store.restore("s1", "failed", "a")
    assert await store.get("s1") == "a"
    store.set("s2", "failed")
    store.restore("s2", "failed", None)
    assert await store.get("s2") is None
    assert len(store) == 1, "a session with no previous endpoint is forgotten"


async def test_a_restore_leaves_a_session_that_moved_on_since() -> None:
    store = InMemoryAffinityStore(ttl_seconds=10, max_sessions=10, clock=ManualClock())
    store.set("s1", "failed")
    store.set("s1", "b")  # a later request of the session, picked meanwhile
    store.restore("s1", "failed", None)
    assert await store.get("s1") == "b"
    store.restore("gone", "failed", "a")  # expired or evicted meanwhile: nothing comes back
    assert await store.get("gone") is None
