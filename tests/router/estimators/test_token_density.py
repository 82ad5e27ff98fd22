"""The bytes-per-token estimator: prior, convergence, drift, implausible samples, the gauge."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from router.estimators.token_density import TokenDensity


def _feed(density: TokenDensity, model: str, ratio: float, n: int, rng: random.Random) -> None:
    """``n`` answers of random length at ``ratio`` bytes a token, +-15% per answer."""
    for _ in range(n):
        size = rng.randint(200, 60_000)
        tokens = max(1, round(size / ratio * rng.uniform(0.85, 1.15)))
        assert density.observe(model, size, tokens)


@pytest.mark.parametrize("true_ratio", [3.0, 9.0])
def test_the_ratio_converges_on_the_texts_density(true_ratio: float) -> None:
    density = TokenDensity(min_samples=8)
    rng = random.Random(int(true_ratio))
    _feed(density, "m", true_ratio, 7, rng)
    assert density.ratio("m") == 4.0  # the prior until enough samples
    _feed(density, "m", true_ratio, 200, rng)
    assert density.ratio("m") == pytest.approx(true_ratio, rel=0.05)
    assert density.ratio("other") == 4.0


def test_the_estimate_follows_a_change_of_text() -> None:
    density = TokenDensity(half_life=32)
    rng = random.Random(5)
    _feed(density, "m", 3.0, 300, rng)
    assert density.ratio("m") == pytest.approx(3.0, rel=0.05)
    _feed(density, "m", 9.0, 300, rng)  # ~10 half-lives later
    assert density.ratio("m") == pytest.approx(9.0, rel=0.05)


def test_implausible_samples_are_dropped_and_the_estimate_is_bounded() -> None:
    density = TokenDensity(min_samples=1, bounds=(1.0, 16.0))
    assert not density.observe("m", 100, 1000)  # an image counted as many tokens
    assert not density.observe("m", 0, 10) and not density.observe("m", 10, 0)
    assert density.samples("m") == 0
    assert density.observe("m", 3000, 100)  # 30 bytes a token: accepted, but clamped
    assert density.ratio("m") == 16.0
    with pytest.raises(ValueError):
        TokenDensity(prior=0.5)


def test_the_ratio_is_exported_per_model() -> None:
    registry = CollectorRegistry()
    density = TokenDensity(registry, min_samples=1)
    density.observe("m", 900, 100)
    assert registry.get_sample_value("prefixgate_bytes_per_token", {"model": "m"}) == 9.0
