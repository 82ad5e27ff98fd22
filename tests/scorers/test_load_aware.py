"""load-aware-scorer: 0.5 on an empty queue, linearly down to 0 at the threshold."""

from __future__ import annotations

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
