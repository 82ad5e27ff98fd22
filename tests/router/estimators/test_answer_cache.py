"""The learned share of a previous answer found cached where its turn was served."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.estimators.answer_cache import AnswerCache


def test_the_prior_stands_until_answers_report_cached_tokens() -> None:
    answers = AnswerCache()
    assert answers.share("m") == 1.0
    answers.observe("m", credited_tokens=20, found_tokens=0)
    assert answers.share("m") == 1.0, "two engine blocks at least, or it says nothing"


def test_a_template_that_drops_the_answer_is_learned_per_model() -> None:
    registry = CollectorRegistry()
    answers = AnswerCache(registry)
    for _ in range(60):
        answers.observe("reasoner", credited_tokens=400, found_tokens=3)
        answers.observe("chat", credited_tokens=400, found_tokens=390)
    assert answers.share("reasoner") < 0.1
    assert answers.share("chat") == pytest.approx(0.975, abs=0.01)
    for _ in range(60):
        answers.observe("reasoner", credited_tokens=400, found_tokens=900)  # capped at 1
    assert answers.share("reasoner") > 0.9, "a model that changes is relearned"
    text = generate_latest(registry).decode()
    assert 'prefixgate_answer_cached_share{model="reasoner"}' in text


def test_models_are_bounded() -> None:
    answers = AnswerCache(max_models=2)
    for model in ("a", "b", "c"):
        answers.observe(model, credited_tokens=100, found_tokens=0)
    assert answers.share("a") == 1.0, "the oldest was dropped"
    assert answers.share("c") < 1.0
