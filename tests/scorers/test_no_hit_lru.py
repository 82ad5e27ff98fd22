"""no-hit-lru-scorer: a new session goes where a new session went least recently."""

from __future__ import annotations

from router.core.framework import RoutingRequest
from scorers.no_hit_lru import NoHitLRUParameters, NoHitLRUScorer
from tests.snapshots import snap

ENDPOINTS = [snap("a"), snap("b"), snap("c")]


def cold(i: int) -> RoutingRequest:
    return RoutingRequest(request_id=f"r{i}", model="m", session_id=f"s{i}", block_hashes=(i,))


def best(scorer: NoHitLRUScorer, request: RoutingRequest) -> str:
    scores = scorer.score(request, ENDPOINTS)
    return ENDPOINTS[scores.index(max(scores))].id


def test_new_sessions_rotate_over_the_pool() -> None:
    scorer = NoHitLRUScorer()
    assert scorer.score(cold(0), ENDPOINTS) == [1.0, 0.5, 0.0]  # never used, in order
    picks = []
    for i in range(6):
        request = cold(i)
        pick = best(scorer, request)
        scorer.on_pick(request, pick)
        picks.append(pick)
    assert picks == ["a", "b", "c", "a", "b", "c"]
    # The least recently used scores 1, the most recently used 0.
    assert scorer.score(cold(9), ENDPOINTS) == [1.0, 0.5, 0.0]


def test_warm_requests_are_neutral_and_do_not_move_the_order() -> None:
    scorer = NoHitLRUScorer()
    hit = RoutingRequest(request_id="h", model="m", prefix_hits={"c": 2}, block_hashes=(1, 2))
    home = RoutingRequest(request_id="s", model="m", session_id="s", affinity_endpoint="b")
    for warm in (hit, home):
        assert scorer.score(warm, ENDPOINTS) == [0.5, 0.5, 0.5]
        scorer.on_pick(warm, "a")
    assert scorer.score(cold(0), ENDPOINTS) == [1.0, 0.5, 0.0], "a was never given a cold one"


def test_scoring_is_pure_and_the_order_is_bounded() -> None:
    scorer = NoHitLRUScorer(NoHitLRUParameters(lru_size=2))
    request = cold(0)
    assert scorer.score(request, ENDPOINTS) == scorer.score(request, ENDPOINTS)
    for endpoint in ("a", "b", "c"):
        scorer.on_pick(cold(1), endpoint)
    # "a" fell out of the bounded order: it counts as never used again.
    assert scorer.score(cold(2), ENDPOINTS) == [1.0, 0.5, 0.0]
    assert scorer.score(cold(3), [snap("only")]) == [1.0]


async def test_an_endpoint_forgotten_counts_as_never_used() -> None:
    """An endpoint that left the pool is forgotten (the gateway calls forget_endpoint as it
    does the index's): back at the same address, it is a new replica no session went to."""
    scorer = NoHitLRUScorer()
    for endpoint in ("a", "b", "c"):
        scorer.on_pick(cold(0), endpoint)
    await scorer.forget_endpoint("c")
    assert scorer.score(cold(1), ENDPOINTS) == [0.5, 0.0, 1.0]
    await scorer.forget_endpoint("unknown")  # never used: nothing to forget
