"""load-aware-scorer: 0.5 on an empty queue, linearly down to 0 at the threshold."""

from __future__ import annotations

import math

import pytest

from router.core.framework import RoutingRequest
from scorers.load_aware import LoadAwareParameters, LoadAwareScorer
from tests.snapshots import snap


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [((0.0, 32.0, 64.0), [0.5, 0.25, 0.0]), ((100.0, 1000.0), [0.0, 0.0]), ((16.0,), [0.375])],
)
def test_absolute_score_per_endpoint(waiting: tuple[float, ...], expected: list[float]) -> None:
    endpoints = [snap(f"e{i}", waiting=w) for i, w in enumerate(waiting)]
    scorer = LoadAwareScorer(LoadAwareParameters(threshold=64))
    assert scorer.score(RoutingRequest(request_id="r", model="m"), endpoints) == expected


def test_default_threshold_is_llm_d_s() -> None:
    scorer = LoadAwareScorer()
    score = scorer.score(RoutingRequest(request_id="r", model="m"), [snap("a", waiting=64.0)])
    assert score == [0.25]


def test_an_endpoint_never_scraped_is_scored_on_the_gateways_requests_waiting_there() -> None:
    """As queue-scorer reads it: no scrape yet, the queue is the gateways' own requests there
    still waiting for a first byte, not an empty one."""
    unseen = snap("unseen", metrics_age=math.inf, pending_prefill_requests=32)
    scorer = LoadAwareScorer(LoadAwareParameters(threshold=64))
    assert scorer.score(RoutingRequest(request_id="r", model="m"), [unseen]) == [0.25]
