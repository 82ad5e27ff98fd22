"""Table-driven tests for every scorer: pure functions of a request and snapshots."""

from __future__ import annotations

import math
from typing import Any

import pytest

from router.core.framework import RoutingRequest
from scorers.inflight import InFlightScorer
from scorers.kv_cache_utilization import KVCacheUtilizationScorer
from scorers.prefix_cache import PrefixCacheScorer
from scorers.queue import QueueScorer
from scorers.scale import inverted_min_max
from scorers.session_affinity import SessionAffinityScorer
from scorers.session_hash import SessionHashScorer
from tests.snapshots import snap


def req(**kw: Any) -> RoutingRequest:
    return RoutingRequest(request_id="r", model="m", **kw)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], []), ([3.0], [1.0]), ([2.0, 2.0], [1.0, 1.0]), ([0.0, 5.0, 10.0], [1.0, 0.5, 0.0])],
)
def test_inverted_min_max(values: list[float], expected: list[float]) -> None:
    assert inverted_min_max(values) == expected


@pytest.mark.parametrize(
    ("hashes", "hits", "expected"),
    [
        ((), {}, [0.0, 0.0]),
        ((1, 2, 3, 4), {}, [0.0, 0.0]),
        ((1, 2, 3, 4), {"a": 4, "b": 1}, [1.0, 0.25]),
        ((1, 2), {"b": 1}, [0.0, 0.5]),
    ],
)
def test_prefix_cache(hashes: tuple[int, ...], hits: dict[str, int], expected: list[float]) -> None:
    request = req(block_hashes=hashes, prefix_hits=hits)
    assert PrefixCacheScorer().score(request, [snap("a"), snap("b")]) == expected


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [((0, 0), [1.0, 1.0]), ((0, 4), [1.0, 0.0]), ((2, 4, 3), [1.0, 0.0, 0.5])],
)
def test_queue(waiting: tuple[float, ...], expected: list[float]) -> None:
    endpoints = [snap(f"e{i}", waiting=w) for i, w in enumerate(waiting)]
    assert QueueScorer().score(req(), endpoints) == expected


@pytest.mark.parametrize(("usage", "expected"), [(0.0, 1.0), (0.25, 0.75), (1.0, 0.0), (1.7, 0.0)])
def test_kv_cache_utilization(usage: float, expected: float) -> None:
    assert KVCacheUtilizationScorer().score(req(), [snap("a", kv_usage=usage)]) == [expected]


def test_inflight_counts_are_min_max_scaled() -> None:
    endpoints = [snap("a", in_flight=1), snap("b", in_flight=3), snap("c", in_flight=5)]
    assert InFlightScorer().score(req(), endpoints) == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("home", "expected"), [(None, [0.0, 0.0]), ("b", [0.0, 1.0]), ("z", [0.0, 0.0])]
)
def test_session_affinity(home: str | None, expected: list[float]) -> None:
    request = req(session_id="s", affinity_endpoint=home)
    assert SessionAffinityScorer().score(request, [snap("a"), snap("b")]) == expected


def test_session_hash_is_stable_and_spreads() -> None:
    endpoints = [snap(f"e{i}") for i in range(4)]
    scorer = SessionHashScorer()
    homes = set()
    for s in range(64):
        scores = scorer.score(req(session_id=f"s{s}"), endpoints)
        assert sorted(scores) == [0.0, 0.0, 0.0, 1.0]
        assert scores == scorer.score(req(session_id=f"s{s}"), list(endpoints))
        homes.add(scores.index(1.0))
    assert homes == {0, 1, 2, 3}
    # Removing an endpoint moves only the sessions that lived there (rendezvous hashing).
    for s in range(64):
        full = scorer.score(req(session_id=f"s{s}"), endpoints)
        if full.index(1.0) != 3:
            fewer = scorer.score(req(session_id=f"s{s}"), endpoints[:3])
            assert fewer.index(1.0) == full.index(1.0)
    assert scorer.score(req(), endpoints) == [0.0] * 4


def test_session_hash_bounds_the_load_a_home_endpoint_takes() -> None:
    """Sessions whose home is over (1 + epsilon) x the average in-flight load go to the next
    endpoint in their hash order; once loads even out they come home again."""
    scorer = SessionHashScorer(epsilon=0.25)
    idle = [snap(f"e{i}") for i in range(4)]
    request = req(session_id="s1")
    home = scorer.score(request, idle).index(1.0)
    busy = [snap(f"e{i}", in_flight=10 if i == home else 0) for i in range(4)]
    spill = scorer.score(request, busy).index(1.0)
    assert spill != home, "10 in flight against an average of 2.75 is over the bound"
    even = [snap(f"e{i}", in_flight=3) for i in range(4)]
    assert scorer.score(request, even).index(1.0) == home


def test_session_hash_with_bounded_loads_spreads_few_sessions_evenly() -> None:
    """Each session's requests add load where they land: 8 live sessions on 8 endpoints end
    up at most 2 per endpoint, where plain hashing piles several on one."""
    endpoints = [f"e{i}" for i in range(8)]
    load = dict.fromkeys(endpoints, 0)
    scorer = SessionHashScorer(epsilon=0.25)
    for s in range(8):
        scores = scorer.score(
            req(session_id=f"sess-{s}"), [snap(e, in_flight=load[e]) for e in endpoints]
        )
        load[endpoints[scores.index(1.0)]] += 1
    assert max(load.values()) <= 2


def test_session_hash_scores_no_candidates_as_every_other_scorer_does() -> None:
    """No candidates, no scores: a session's request must not raise (IndexError) where
    every other scorer answers an empty list."""
    scorer = SessionHashScorer()
    assert scorer.score(req(session_id="s"), []) == []
    assert scorer.score(req(block_hashes=(7,)), []) == []


def test_queue_of_an_endpoint_never_scraped_is_the_gateways_requests_waiting_there() -> None:
    """No scrape yet (a pod that just joined, a backend without /metrics): its queue is the
    gateways' requests there still waiting for a first byte. Read as an empty queue, a backend
    without /metrics scored idle however many requests waited there."""
    endpoints = [
        snap("seen", waiting=2.0),
        snap("unseen-busy", metrics_age=math.inf, pending_prefill_requests=6),
        snap("unseen-idle", metrics_age=math.inf),
    ]
    assert QueueScorer().score(req(), endpoints) == pytest.approx([4 / 6, 0.0, 1.0])
