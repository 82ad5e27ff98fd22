"""The exponential average kept per model."""

from __future__ import annotations

import pytest

from router.estimators.model_average import ModelAverage


def test_from_a_prior_or_from_the_first_value() -> None:
    with_prior = ModelAverage(decay=0.5, max_models=4, prior=1.0)
    without = ModelAverage(decay=0.5, max_models=4)
    assert (with_prior.get("m"), without.get("m")) == (1.0, None)
    with_prior.observe("m", 0.0)
    without.observe("m", 10.0)
    assert (with_prior.get("m"), without.get("m")) == (0.5, 10.0)
    without.observe("m", 20.0)
    assert without.get("m") == pytest.approx(15.0)


def test_the_models_updated_last_are_kept_and_exported() -> None:
    averages = ModelAverage(decay=0.5, max_models=2)
    for model in ("a", "b", "a", "c"):
        averages.observe(model, 1.0)
    assert averages.get("b") is None, "updated least recently: dropped"
    gauge = averages.gauge("g", "doc")
    assert sorted(s.labels["model"] for s in gauge.samples) == ["a", "c"]
