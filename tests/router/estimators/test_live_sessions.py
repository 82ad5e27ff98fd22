"""Live sessions: who counts, for how long, and the context each endpoint must keep."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.core.framework import RoutingRequest
from router.estimators.live_sessions import MIN_HORIZON_S, LiveSessions
from tests.manual_clock import ManualClock
from tests.snapshots import snap


def req(session: str | None, tokens: int) -> RoutingRequest:
    return RoutingRequest(request_id="r", model="m", session_id=session, prompt_tokens=tokens)


async def test_a_session_counts_once_it_comes_back_and_leaves_its_old_home() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    live.on_pick(req("s", 4_000), "a")
    assert live.live_tokens("a") == 0  # one request: it may never come back
    clock.now += 2.0
    live.on_pick(req("s", 5_000), "a")
    live.on_pick(req("t", 1_000), "a")
    live.on_pick(req(None, 9_000), "a")  # no session: nothing to keep for it
    assert live.live_tokens("a") == 5_000
    clock.now += 2.0
    live.on_pick(req("s", 6_000), "b")  # moved: its context on "a" is no longer wanted
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 6_000)
    # Scoring a request excludes its own session: its context is extended, not evicted.
    request = req("s", 6_500)
    await live.produce(request, [snap("a"), snap("b")])
    assert request.live_tokens == {"a": 0, "b": 0}
    other = req("u", 1_000)
    await live.produce(other, [snap("a"), snap("b")])
    assert other.live_tokens == {"a": 0, "b": 6_000}


def test_sessions_expire_after_a_few_of_their_usual_gaps() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    for _ in range(60):  # a session every 2 s: the typical gap converges there
        live.on_pick(req("s", 1_000), "a")
        clock.now += 2.0
    assert live.typical_gap == pytest.approx(2.0, rel=0.1)
    assert live.live_tokens("a") == 1_000
    clock.now += live.horizon  # quiet for longer than three of its gaps: gone
    assert live.live_tokens("a") == 0
    # Back: live again at once. Parallel sub-agent requests are a burst, not a pace.
    live.on_pick(req("s", 1_000), "a")
    assert live.live_tokens("a") == 1_000
    pace = live.typical_gap
    for _ in range(100):
        live.on_pick(req("s", 1_000), "a")
    assert live.typical_gap == pace
    assert LiveSessions().horizon >= MIN_HORIZON_S


def test_the_live_contexts_are_exported() -> None:
    clock = ManualClock(100.0)
    registry = CollectorRegistry()
    live = LiveSessions(clock=clock, registry=registry)
    for _ in range(2):
        live.on_pick(req("s", 700), "a")
    text = generate_latest(registry).decode()
    assert 'prefixgate_live_session_context_tokens{endpoint="a"} 700.0' in text
    assert "prefixgate_live_sessions 1.0" in text
    assert f"prefixgate_live_session_horizon_seconds {live.horizon}" in text


def test_the_table_is_bounded() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(max_sessions=3, clock=clock)
    for i in range(6):
        for _ in range(2):
            live.on_pick(req(f"s{i}", 100), "a")
    assert live.live_tokens("a") == 300



async def test_a_new_sessions_first_request_is_told_how_many_requests_follow_it() -> None:
    clock = ManualClock(100.0)
    registry = CollectorRegistry()
    live = LiveSessions(clock=clock, registry=registry)
    for n in range(10):  # sessions of twelve requests each
        for _ in range(12):
            live.on_pick(req(f"s{n}", 1_000), "a")
            clock.now += 1.0
    expected = live.lengths.later_requests
    assert expected > 5
    new, known, anonymous = req("new", 1_000), req("s9", 1_000), req(None, 1_000)
    for r in (new, known, anonymous):
        await live.produce(r, [snap("a")])
    assert (new.later_requests, known.later_requests, anonymous.later_requests) == (
        expected, 0, 0
    )
    text = generate_latest(registry).decode()
    assert f"prefixgate_session_later_requests {expected}" in text


def test_a_restarted_endpoint_holds_no_live_context_until_its_sessions_come_back() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    for session, home in (("s", "a"), ("t", "a"), ("u", "b")):
        live.on_pick(req(session, 1_000), home)
        live.on_pick(req(session, 2_000), home)
    assert (live.live_tokens("a"), live.live_tokens("b")) == (4_000, 2_000)
    live.clear_endpoint("a")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 2_000)
    clock.now += 1.0
    live.on_pick(req("s", 3_000), "a")  # back on the new engine: counted again
    assert live.live_tokens("a") == 3_000


def test_a_retried_request_moves_its_session_but_is_not_its_second_request() -> None:
    # Failover picks the same request again on the next endpoint (router/api/failover.py):
    # that is where the session's context now is, not the session coming back. Counted as a
    # second request, a single-turn session became live and the retry's delay (a first-byte
    # timeout) was learned as the sessions' pace.
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    pace = live.typical_gap
    request = RoutingRequest(request_id="r", model="m", session_id="s", prompt_tokens=4_000,
                             serial=7)
    live.on_pick(request, "a")
    clock.now += 30.0  # the first endpoint never answered
    live.on_pick(request, "b")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 0)
    assert live.typical_gap == pace
    clock.now += 2.0
    back = RoutingRequest(request_id="r2", model="m", session_id="s", prompt_tokens=5_000,
                          serial=8)
    live.on_pick(back, "b")  # its real second request: live where the retry left it
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 5_000)
    assert live.typical_gap == pytest.approx(2.0)  # from the retry, its last activity
    # Single-turn sessions, each retried once, are sessions of one request.
    for n in range(100):
        single = RoutingRequest(request_id="r", model="m", session_id=f"one{n}", serial=100 + n)
        live.on_pick(single, "a")
        live.on_pick(single, "b")
    clock.now += 1_000.0
    assert live.live_tokens("a") == 0  # every session ended
    assert live.lengths.later_requests < 0.5  # 1.2 with each retry counted as a request


def test_a_retried_live_sessions_context_follows_it() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    for serial in (1, 2):
        clock.now += 1.0
        live.on_pick(RoutingRequest(request_id="r", model="m", session_id="s",
                                    prompt_tokens=1_000 * serial, serial=serial), "a")
    retried = RoutingRequest(request_id="r", model="m", session_id="s", prompt_tokens=3_000,
                             serial=3)
    clock.now += 1.0
    live.on_pick(retried, "a")
    clock.now += 5.0
    live.on_pick(retried, "b")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 3_000)
    assert live.typical_gap == pytest.approx(1.0)


def test_a_request_that_failed_everywhere_leaves_its_session_where_it_was() -> None:
    # Its first pick is withdrawn (on_unpick) when that attempt fails before its first byte:
    # the endpoint never received the context, the session's previous home still holds it.
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)

    def turn(session: str, tokens: int, serial: int) -> RoutingRequest:
        return RoutingRequest(
            request_id="r", model="m", session_id=session, prompt_tokens=tokens, serial=serial
        )

    for serial in (1, 2):
        clock.now += 1.0
        live.on_pick(turn("s", 1_000 * serial, serial), "a")
    failed = turn("s", 3_000, 3)
    clock.now += 1.0
    live.on_pick(failed, "b")
    live.on_unpick(failed, "b")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (2_000, 0)
    live.on_pick(failed, "c")  # a retry answered: the session follows it, as ever
    assert (live.live_tokens("a"), live.live_tokens("c")) == (0, 3_000)
    # A new session whose only request failed everywhere counts nowhere, then or later.
    only = turn("t", 4_000, 9)
    live.on_pick(only, "b")
    live.on_unpick(only, "b")
    clock.now += 1.0
    live.on_pick(turn("t", 5_000, 10), "c")
    assert live.live_tokens("b") == 0
    assert live.live_tokens("c") == 3_000, "t's next request is its first served one"


def agent_req(session: str, blocks: list[int], hits: dict[str, int]) -> RoutingRequest:
    """A prompt of 100-token blocks (400 bytes each, 4 bytes a token)."""
    return RoutingRequest(
        request_id="r", model="m", session_id=session, prompt_tokens=100 * len(blocks),
        prompt_bytes=400 * len(blocks), block_bytes=400, block_hashes=blocks, prefix_hits=hits,
    )


async def turn(live: LiveSessions, request: RoutingRequest, endpoint: str) -> None:
    await live.produce(request, [snap("a"), snap("b")])
    live.on_pick(request, endpoint)


async def test_sessions_sharing_a_system_prompt_keep_it_once_on_their_endpoint() -> None:
    clock = ManualClock(100.0)
    live = LiveSessions(clock=clock)
    system = [1, 2, 3, 4, 5, 6]  # 600 tokens every session of the agent type starts with
    await turn(live, agent_req("s", [*system, 10], {}), "a")  # the type's first: nothing shared
    await turn(live, agent_req("t", [*system, 20], {"a": 6}), "a")
    await turn(live, agent_req("u", [*system, 30], {"a": 6}), "a")
    for session, own in (("s", 10), ("t", 20), ("u", 30)):
        clock.now += 1.0
        await turn(live, agent_req(session, [*system, own, own + 1], {"a": 8}), "a")
    # s counts its whole 800-token context (its prompt was the type's first); t and u their
    # 200 own tokens each and the 600 shared once between them.
    assert live.live_tokens("a") == 800 + 200 + 200 + 600
    # A request of t would evict only what others keep: its own tokens are extended, and the
    # shared prompt stays for u.
    request = agent_req("t", [*system, 20, 21, 22], {"a": 8})
    await live.produce(request, [snap("a"), snap("b")])
    assert request.shared_prefix is not None and request.shared_prefix.tokens == 600
    assert request.live_tokens == {"a": 800 + 200 + 600, "b": 0}
    # t moves to b: it takes the shared prompt along (counted there), u still keeps it on a.
    clock.now += 1.0
    live.on_pick(request, "b")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (800 + 200 + 600, 900)
    # u moves too: now no one keeps the shared prompt on a.
    await turn(live, agent_req("u", [*system, 30, 31, 32], {"a": 8}), "b")
    assert (live.live_tokens("a"), live.live_tokens("b")) == (800, 300 + 300 + 600)
    # Expired, every count goes: nothing is left over.
    clock.now += live.horizon + 1.0
    assert (live.live_tokens("a"), live.live_tokens("b")) == (0, 0)


async def test_a_prompt_that_no_longer_starts_with_the_shared_prefix_shares_nothing() -> None:
    live = LiveSessions(clock=ManualClock(100.0))
    first = agent_req("s", [1, 2, 3, 9], {"a": 3, "b": 2})  # the longest match anywhere
    await live.produce(first, [snap("a"), snap("b")])
    assert first.shared_prefix is not None
    assert (first.shared_prefix.key, first.shared_prefix.tokens) == (3, 300)
    live.on_pick(first, "a")
    # A compacted context: a new chain from its start.
    compacted = agent_req("s", [7, 8], {})
    await live.produce(compacted, [snap("a"), snap("b")])
    assert compacted.shared_prefix is None
    # A request without a session names no shared prefix.
    anonymous = RoutingRequest(request_id="r", model="m", prompt_tokens=400, prompt_bytes=1600,
                               block_bytes=400, block_hashes=[1, 2, 3, 9], prefix_hits={"a": 3})
    await live.produce(anonymous, [snap("a")])
    assert anonymous.shared_prefix is None


async def test_a_sessions_shared_prefix_is_counted_at_the_latest_tokens_a_byte() -> None:
    """A session's first request may come before the gateway has learned the model's bytes a
    token: its later requests count the shared prefix again, at the ratio their own prompt
    counts carry, and the live contexts follow."""
    live = LiveSessions(clock=ManualClock(100.0))
    system = [1, 2, 3, 4, 5, 6]
    await turn(live, agent_req("s", [*system, 10], {}), "a")
    first = agent_req("t", [*system, 20], {"a": 6})  # counted at 4 bytes a token: 600 shared
    await turn(live, first, "a")
    assert first.shared_prefix is not None and first.shared_prefix.tokens == 600
    # Learned since: 10 bytes a token, so the same 400-byte blocks hold 40 tokens each.
    later = RoutingRequest(
        request_id="r", model="m", session_id="t", prompt_tokens=40 * 8, prompt_bytes=400 * 8,
        block_bytes=400, block_hashes=[*system, 20, 21], prefix_hits={"a": 7},
    )
    await turn(live, later, "a")
    assert later.shared_prefix is not None
    assert (later.shared_prefix.key, later.shared_prefix.tokens) == (6, 240)
    # t, live from its second request: its 80 own tokens and the prefix at its latest count
    # (s has not come back: not live).
    assert live.live_tokens("a") == 80 + 240
