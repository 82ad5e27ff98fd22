"""The Redis fixtures themselves: a slow machine gets time, and CI never skips silently.

A Redis Cluster of private nodes can take seconds to form on a loaded 2-core machine; giving up
early skipped the cluster tests, and a skip in CI goes unnoticed. So: a bounded but generous
deadline, a failure instead of a skip under CI, ``.ci/run`` setting CI, and skip reasons shown.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests import redis_cluster
from tests.redis_server import unavailable

ROOT = Path(__file__).resolve().parents[1]


class FakeTime:
    """Stands in for the ``time`` module of tests/redis_cluster.py: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.longest_sleep = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.longest_sleep = max(self.longest_sleep, seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setattr(redis_cluster, "time", clock)
    return clock


def test_a_cluster_slow_to_form_on_a_loaded_machine_is_waited_for(fake_time: FakeTime) -> None:
    redis_cluster._wait(lambda: fake_time.now >= 20.0, "not formed")
    assert 20.0 <= fake_time.now < 21.0
    assert fake_time.longest_sleep <= 0.1, "polled with small sleeps"


def test_a_cluster_that_never_forms_is_given_up_on_in_bounded_time(fake_time: FakeTime) -> None:
    with pytest.raises(RuntimeError, match="not formed within"):
        redis_cluster._wait(lambda: False, "not formed")
    assert 30.0 <= fake_time.now <= 31.0


def test_no_redis_skips_with_the_reason_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no redis-server"):
        unavailable("no redis-server")


def test_no_redis_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="Redis needed under CI: no redis-server"):
        unavailable("no redis-server")


def test_ci_run_sets_ci_before_the_tests() -> None:
    """Without CI set, a cluster that does not form skips, and CI reports a pass."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    pytest_at = lines.index("python -m pytest -q")
    assert "export CI=1" in lines[:pytest_at]


def test_every_run_shows_skip_reasons_and_still_lists_failures() -> None:
    """``-r`` replaces its default (``fE``): failures and errors must stay in the summary."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"].split()
    chars = next(opt[2:] for opt in addopts if opt.startswith("-r"))
    assert set("fEs") <= set(chars)
