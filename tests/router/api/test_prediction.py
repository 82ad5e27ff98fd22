"""The prediction tracker: what the cached tokens an answer reports teach."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.api.prediction import PredictionTracker
from router.core.framework import RoutingRequest
from router.estimators.answer_cache import AnswerCache


def test_the_answers_found_cached_teach_the_answer_share() -> None:
    answers = AnswerCache()
    tracker = PredictionTracker(CollectorRegistry(), block_size=16, answers=answers)
    # 4,000 bytes for 1,000 tokens; the endpoint matched 2,000 bytes (500 tokens) and served
    # the turn whose 1,400-byte answer (350 tokens) comes next.
    routing = RoutingRequest(
        request_id="r", model="m", prompt_bytes=4000, prompt_tokens=1000, block_bytes=1000,
        block_hashes=(1, 2, 3, 4), answer_bytes=(2500, 3400), prefix_hits={"home": 2},
    )

    def answered(cached: int) -> None:
        usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": cached}}
        tracker.observe("home", routing, usage)

    answered(848)  # the answer's whole blocks: nothing to learn from
    assert answers.share("m") == 1.0
    answered(300)  # the matched prefix itself was evicted: says nothing about the answer
    assert answers.share("m") == 1.0
    for _ in range(40):
        answered(512)  # the prefix up to the answer, and none of it (a reasoning template)
    assert answers.share("m") < 0.2
    assert tracker.summary["approximate"].count == 42
