"""The learned mean answer length, per model: the KV an answer adds while it decodes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.estimators.answer_lengths import AnswerLengths


def test_nothing_is_expected_until_an_answer_is_read_then_the_mean_is_learned() -> None:
    registry = CollectorRegistry()
    lengths = AnswerLengths(registry)
    assert lengths.tokens("m") == 0
    assert "prefixgate_answer_tokens{" not in generate_latest(registry).decode()
    lengths.observe("m", 300)
    assert lengths.tokens("m") == 300, "the first answer is the estimate"
    for _ in range(100):
        lengths.observe("m", 100)
        lengths.observe("m", 300)
    assert lengths.tokens("m") == pytest.approx(200, abs=10)
    assert lengths.tokens("other") == 0, "per model"
    assert 'prefixgate_answer_tokens{model="m"}' in generate_latest(registry).decode()


def test_models_are_bounded() -> None:
    lengths = AnswerLengths(max_models=2)
    for model in ("a", "b", "c"):
        lengths.observe(model, 100)
    assert (lengths.tokens("a"), lengths.tokens("c")) == (0, 100), "the oldest was dropped"
