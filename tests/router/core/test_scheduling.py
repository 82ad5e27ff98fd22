from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from router.config.model import builtin_strategy as strategy
from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest, Scheduler, SchedulingProfile, WeightedScorer
from router.index.affinity import InMemoryAffinityStore
from router.index.prefix_index import InMemoryPrefixIndex
from router.scheduling.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker
from router.scheduling.plugins import PluginContext, build_profile, default_registry
from router.scheduling.producers import AffinityTracker, PrefixTracker
from scorers.prefix_cache import PrefixCacheScorer
from scorers.queue import QueueScorer
from tests.snapshots import snap


def req(**kw: Any) -> RoutingRequest:
    return RoutingRequest(request_id="r", model="m", **kw)


class OnlyB:
    def filter(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[EndpointSnapshot]:
        return [e for e in endpoints if e.id == "b"]


def test_weighted_sum_and_breakdown() -> None:
    profile = SchedulingProfile(
        "p",
        MaxScorePicker(random.Random(0)),
        [
            WeightedScorer("prefix", PrefixCacheScorer(), 3.0),
            WeightedScorer("q", QueueScorer(), 2.0),
        ],
    )
    request = req(block_hashes=(1, 2), prefix_hits={"a": 2})
    decision = profile.run(request, [snap("a", waiting=4), snap("b", waiting=0)])
    assert decision.scores == {"a": 3.0, "b": 2.0}
    assert [e.id for e in decision.ranked] == ["a", "b"]
    assert decision.breakdown == {}, "kept only for an explanation"
    explained = req(block_hashes=(1, 2), prefix_hits={"a": 2}, explain=True)
    decision = profile.run(explained, [snap("a", waiting=4), snap("b", waiting=0)])
    assert decision.breakdown["b"] == {"prefix": 0.0, "q": 1.0}


def test_filters_narrow_and_empty_result() -> None:
    profile = SchedulingProfile("p", MaxScorePicker(random.Random(0)), [], [OnlyB()])
    assert [e.id for e in profile.run(req(), [snap("a"), snap("b")]).ranked] == ["b"]
    assert profile.run(req(), [snap("a")]).ranked == []


def test_ties_are_broken_at_random() -> None:
    picker = MaxScorePicker(random.Random(7))
    endpoints = [snap(f"e{i}") for i in range(4)]
    firsts = {picker.pick(req(), endpoints, [1.0] * 4)[0].id for _ in range(200)}
    assert firsts == {"e0", "e1", "e2", "e3"}
    assert picker.pick(req(), endpoints, [0.0, 2.0, 1.0, 0.5])[0].id == "e1"


def test_round_robin_and_random_pickers() -> None:
    endpoints = [snap("b"), snap("a"), snap("c")]
    rr = RoundRobinPicker()
    assert [rr.pick(req(), endpoints, [0.0] * 3)[0].id for _ in range(4)] == ["a", "b", "c", "a"]
    rnd = RandomPicker(random.Random(3))
    assert sorted(e.id for e in rnd.pick(req(), endpoints, [0.0] * 3)) == ["a", "b", "c"]
    assert rr.pick(req(), [], []) == []


async def test_gather_score_update_cycle() -> None:
    index = InMemoryPrefixIndex()
    store = InMemoryAffinityStore()
    prefix, sessions = PrefixTracker(index), AffinityTracker(store)
    plugins, profile_cfg = strategy("default")
    profile = build_profile(
        plugins, profile_cfg, default_registry(), PluginContext(random.Random(0))
    )
    scheduler = Scheduler(profile, [prefix, sessions], [prefix, sessions])
    endpoints = [snap("a"), snap("b"), snap("c")]
    first = req(session_id="s", block_hashes=(1, 2, 3))
    await scheduler.gather(first, endpoints)
    decision = scheduler.profile.run(first, endpoints)
    home = decision.ranked[0].id
    scheduler.picked(first, home)
    # The next turn of the session extends the chain: it must go home, via index and affinity.
    second = req(session_id="s", block_hashes=(1, 2, 3, 4, 5))
    await scheduler.gather(second, endpoints)
    decision = scheduler.profile.run(second, endpoints)
    assert second.prefix_hits[home] == 3
    assert second.affinity_endpoint == home
    assert decision.ranked[0].id == home


async def test_load_pulls_new_sessions_apart() -> None:
    plugins, profile_cfg = strategy("default")
    profile = build_profile(
        plugins, profile_cfg, default_registry(), PluginContext(random.Random(0))
    )
    busy, idle = snap("a", in_flight=8, waiting=3), snap("b")
    assert profile.run(req(block_hashes=(1,)), [busy, idle]).ranked[0].id == "b"


def test_uncached_tokens_estimate() -> None:
    request = req(
        prompt_bytes=4000, prompt_tokens=1000, block_bytes=1000, block_hashes=(1, 2, 3, 4)
    )
    request.prefix_hits = {"a": 3}
    assert request.uncached_tokens("a") == 250
    assert request.uncached_tokens("b") == 1000
    assert req(prompt_tokens=7).uncached_tokens("a") == 7


def test_the_last_answer_is_cached_where_its_turn_was_served() -> None:
    # Bytes 0-2500: the previous turn's prompt (two full 1000-byte blocks indexed); 2500-3400:
    # the answer it generated; then the new message.
    request = req(
        prompt_bytes=4000, prompt_tokens=1000, block_bytes=1000, block_hashes=(1, 2, 3, 4),
        answer_bytes=(2500, 3400),
    )
    request.prefix_hits = {"home": 2, "short": 1, "longer": 4}
    assert request.cached_bytes("home") == 3400, "every block before the answer matched"
    assert request.uncached_tokens("home") == 150
    assert request.cached_bytes("short") == 1000, "it never saw the turn that generated it"
    assert request.cached_bytes("none") == 0
    assert request.cached_bytes("longer") == 4000
    early = req(
        prompt_bytes=4000, prompt_tokens=1000, block_bytes=1000, block_hashes=(1, 2, 3, 4),
        answer_bytes=(500, 900),
    )
    assert early.cached_bytes("home") == 0, "no block matched, nothing is credited"
    request.answer_share = 0.5  # the model's answers are found cached half the time
    assert request.cached_bytes("home") == 2000 + 700
    assert request.answer_bytes_beyond("home") == 1400
    assert request.cached_bytes("longer") == 4000
