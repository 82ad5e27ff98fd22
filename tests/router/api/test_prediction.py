"""The prediction tracker: what the cached tokens an answer reports teach."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from router.api.prediction import PredictionTracker
from router.core.framework import RoutingRequest
from router.estimators.answer_cache import AnswerCache
from router.estimators.answer_lengths import AnswerLengths


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


def test_a_follow_up_of_a_stored_response_is_no_prediction_of_the_index() -> None:
    """A ``previous_response_id`` follow-up's rendered input is the end of the replica's
    prompt: the index is not asked (the stored response pins it), so the stored history the
    replica finds cached is no under-prediction of the index."""
    tracker = PredictionTracker(CollectorRegistry(), block_size=16)
    follow_up = RoutingRequest(
        request_id="r", model="m", api="responses", prompt_bytes=400, prompt_tokens=100,
        block_bytes=256, previous_response_id="resp_1",
    )
    usage = {"input_tokens": 9000, "input_tokens_details": {"cached_tokens": 8960}}
    tracker.observe("home", follow_up, usage)
    assert tracker.summary["approximate"].count == 0
    short = RoutingRequest(request_id="s", model="m", prompt_bytes=100, block_bytes=256)
    tracker.observe("home", short, {"prompt_tokens": 25, "prompt_tokens_details": {
        "cached_tokens": 0}})
    assert tracker.summary["approximate"].count == 1, "a prompt shorter than a block: 0 it is"


def test_a_decode_after_a_remote_prefill_is_no_prediction_of_the_index() -> None:
    """vLLM counts the KV a decode endpoint pulled from a prefill endpoint as cached (llm-d's
    sidecar rewrites that count for its clients): the index, which saw the prompt uncached
    there, was not wrong, nor does the count say how much of the last answer was held."""
    tracker = PredictionTracker(CollectorRegistry(), block_size=16)
    routing = RoutingRequest(
        request_id="r", model="m", prompt_bytes=4000, prompt_tokens=1000, block_bytes=1000,
        block_hashes=(1, 2, 3, 4), prefix_hits={"decode": 1}, remote_prefill=True,
    )
    usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 992}}
    tracker.observe("decode", routing, usage)
    assert tracker.summary["approximate"].count == 0
    assert tracker.skips == {"remote_prefill": 1}


def test_every_answer_read_teaches_its_models_answer_length() -> None:
    """The answer's length counts whatever else its usage reports (no cached tokens, a decode
    after a remote prefill); a prefill step's one token is no answer."""
    lengths = AnswerLengths()
    tracker = PredictionTracker(CollectorRegistry(), block_size=16, lengths=lengths)
    routing = RoutingRequest(request_id="r", model="m", prompt_bytes=400, prompt_tokens=100)
    tracker.observe("a", routing, {"prompt_tokens": 100, "completion_tokens": 250})
    assert lengths.tokens("m") == 250
    step = RoutingRequest(request_id="p", model="m", prefill_step=True)
    decode = RoutingRequest(request_id="d", model="m", remote_prefill=True)
    for _ in range(50):
        tracker.observe("a", step, {"prompt_tokens": 100, "completion_tokens": 1})
    assert lengths.tokens("m") == 250
    for _ in range(100):
        tracker.observe("a", decode, {"prompt_tokens": 100, "completion_tokens": 50})
    assert lengths.tokens("m") == pytest.approx(50, abs=2)
