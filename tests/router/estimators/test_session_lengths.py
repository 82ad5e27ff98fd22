"""Session lengths: what a new session's first request is charged for, learned from traffic."""

from __future__ import annotations

import pytest

from router.estimators.session_lengths import PRIOR_REQUESTS, SessionLengths


def _sessions(lengths: SessionLengths, prefix: str, count: int, size: int, now: float) -> None:
    for n in range(count):
        for _ in range(size):
            lengths.on_request(f"{prefix}-{n}", now)


def test_before_any_session_ends_the_prior_holds_and_young_sessions_do_not_lower_it() -> None:
    lengths = SessionLengths()
    assert lengths.later_requests == PRIOR_REQUESTS - 1
    _sessions(lengths, "young", 20, 2, now=0.0)  # a ramp-up: every session still running
    assert lengths.later_requests == PRIOR_REQUESTS - 1
    assert lengths.is_new("other") and not lengths.is_new("young-3")


def test_long_sessions_raise_it_as_soon_as_they_are_counted() -> None:
    lengths = SessionLengths()
    _sessions(lengths, "long", 10, 30, now=0.0)
    assert lengths.later_requests == pytest.approx(29.0)  # requests per session started


def test_single_turn_traffic_pulls_it_to_nothing_once_its_sessions_end() -> None:
    lengths = SessionLengths()
    _sessions(lengths, "one", 400, 1, now=0.0)
    assert lengths.later_requests == PRIOR_REQUESTS - 1  # not known to have ended yet
    lengths.expire(cutoff=1.0)
    assert lengths.later_requests == pytest.approx((400 + 4 * PRIOR_REQUESTS) / 404 - 1)
    assert lengths.later_requests < 0.1
    assert lengths.is_new("one-0")  # ended: if it comes back, it is a new session


def test_ended_sessions_are_counted_once_with_all_their_requests() -> None:
    lengths = SessionLengths()
    _sessions(lengths, "a", 4, 3, now=0.0)
    lengths.on_request("b-0", 5.0)
    lengths.expire(cutoff=1.0)  # the four a-sessions ended; b-0 has not
    lengths.expire(cutoff=1.0)
    assert lengths.later_requests == pytest.approx((4 * 3 + 4 * PRIOR_REQUESTS) / 8 - 1)
    assert not lengths.is_new("b-0")


def test_the_window_follows_the_traffic_and_the_table_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("router.estimators.session_lengths.LENGTH_WINDOW", 100)
    lengths = SessionLengths(max_sessions=5)
    _sessions(lengths, "long", 20, 40, now=0.0)
    lengths.expire(cutoff=1.0)
    assert lengths.later_requests > 20
    for t in range(1, 400):  # then single requests, each ending before the next
        _sessions(lengths, f"single{t}", 1, 1, now=float(t))
        lengths.expire(cutoff=float(t))
    # The long sessions were halved away; 50-100 single ones and the prior are left.
    assert lengths.later_requests < 0.6
    assert len(lengths._open) <= 5
