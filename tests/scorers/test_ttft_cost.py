from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot, SharedPrefix
from router.core.framework import RoutingRequest
from router.estimators.calibration import Calibrator
from router.precise.routing import precise_enabled
from scorers.ttft_cost import TTFTCostParameters, TTFTCostScorer
from tests.snapshots import FixedScores
from tests.snapshots import snap as base_snap


def snap(eid: str, **kw: Any) -> EndpointSnapshot:
    return base_snap(eid, **{"block_size": 16, "num_gpu_blocks": 10_000, **kw})


def req(tokens: int = 10_000, hits: dict[str, int] | None = None, **kw: Any) -> RoutingRequest:
    blocks = tokens * 4 // 256
    return RoutingRequest(
        request_id="r",
        model="m",
        prompt_tokens=tokens,
        prompt_bytes=tokens * 4,
        block_bytes=256,
        block_hashes=tuple(range(blocks)),
        prefix_hits=hits or {},
        **kw,
    )


def scorer(**params: Any) -> TTFTCostScorer:
    return TTFTCostScorer(Calibrator(), TTFTCostParameters(**params))


def test_cache_hit_wins_when_queues_are_equal() -> None:
    s = scorer()
    scores = s.score(req(hits={"home": 150}), [snap("home"), snap("other")])
    assert scores[0] == 1.0 and scores[1] < 0.2


def test_magnitudes_survive_a_small_miss_is_not_a_large_miss() -> None:
    s = scorer()
    small = s.terms(req(tokens=50), snap("a")).total_s
    large = s.terms(req(tokens=50_000), snap("a")).total_s
    assert large > 100 * (small - 0.03)


def test_sticky_until_the_home_queue_costs_more_than_moving() -> None:
    s = scorer()
    request = req(tokens=10_000, hits={"home": 150})  # ~96% cached at home
    # A modest queue at home: staying is still cheaper than recomputing 10K tokens.
    assert s.score(request, [snap("home", pending_prefill_tokens=3_000), snap("b")])[0] == 1.0
    # A long queue at home: moving wins.
    assert s.score(request, [snap("home", pending_prefill_tokens=40_000), snap("b")])[1] == 1.0


def test_new_work_spreads_by_load_and_foreign_queues_count() -> None:
    s = scorer()
    scores = s.score(req(tokens=500), [snap("a", in_flight=30), snap("b", in_flight=2)])
    assert scores[1] == 1.0 > scores[0]
    # Requests waiting in a replica that this gateway did not send are priced with a prior.
    terms = s.terms(req(tokens=500), snap("a", waiting=10, in_flight=2))
    assert terms.queued_tokens == 8 * 512


@pytest.mark.parametrize(
    ("usage", "in_flight_kv", "scraped_kv", "expected_s"),
    [
        (0.5, 0, 0, 0.0),  # 80,000 of 160,000 held + 8,000: fits
        (0.0, 0, 0, 0.0),  # nothing held
        (0.97, 0, 0, 3_200 / 155_200 * 20.0),  # others hold 155,200: 3,200 over
        (0.0, 155_200, 0, 3_200 / 155_200 * 20.0),  # ours, sent since the scrape
        (0.97, 155_200, 155_200, 3_200 / 155_200 * 20.0),  # ours, seen by the scrape: once
        (0.97, 0, 155_200, 0.0),  # ours, seen by the scrape and ended since: room
        (1.0, 0, 0, 8_000 / 160_000 * 20.0),
    ],
)
def test_kv_wait(usage: float, in_flight_kv: int, scraped_kv: int, expected_s: float) -> None:
    """A request that does not fit beside what runs waits until enough of it ends: what is
    held frees about once a hold time."""
    endpoint = snap(
        "a", kv_usage=usage, in_flight_kv_tokens=in_flight_kv, scraped_kv_tokens=scraped_kv,
        hold_s=20.0,
    )
    terms = scorer().terms(req(tokens=8_000), endpoint)
    assert terms.kv_wait_s == pytest.approx(expected_s)
    assert scorer(kv_wait_weight=0).terms(req(tokens=8_000), endpoint).kv_wait_s == 0
    unknown = snap("a", kv_usage=0.99, num_gpu_blocks=None, hold_s=20.0)
    assert scorer().terms(req(tokens=8_000), unknown).kv_wait_s == 0


def test_kv_wait_beyond_what_the_cache_holds_goes_in_waves() -> None:
    """Requests sent beyond what the cache holds wait in the engine for room: no more than the
    cache holds runs at once, so what is ahead of a request frees one cacheful a hold time."""
    crowded = snap("a", num_gpu_blocks=1_000, in_flight_kv_tokens=40_000, hold_s=20.0)
    terms = scorer().terms(req(tokens=8_000), crowded)
    assert terms.kv_wait_s == pytest.approx(32_000 / 16_000 * 20.0)


def test_sub_agents_beyond_their_homes_cache_wait_there() -> None:
    """Sub-agents forked from one context share it, but what each computes is its own: many
    at home at once fill its cache, and the next one goes where it fits at once."""
    fanned = {"s": [24, 12_800, 24 * 384, 384]}  # the context once, and 24 x 384 of their own
    home = snap(
        "home", num_gpu_blocks=1_000, in_flight_kv_tokens=12_800 + 23 * 384, hold_s=20.0,
        session_kv=fanned,
    )
    other = snap("other", num_gpu_blocks=1_000, hold_s=20.0)
    sub = req(tokens=12_800, hits={"home": 194}, session_id="s", affinity_endpoint="home")
    assert sub.uncached_tokens("home") == 384
    terms = scorer().terms(sub, home)
    excess = 12_800 + 24 * 384 - 16_000
    assert terms.kv_wait_s == pytest.approx(excess / 16_000 * 20.0)
    assert scorer().score(sub, [home, other])[1] == 1.0
    few = snap(
        "home", num_gpu_blocks=1_000, in_flight_kv_tokens=12_800 + 384, hold_s=20.0,
        session_kv={"s": [2, 12_800, 768, 384]},
    )
    assert scorer().terms(sub, few).kv_wait_s == 0
    assert scorer().score(sub, [few, other])[0] == 1.0


def test_a_prefix_other_sessions_run_with_is_held_once() -> None:
    """Sessions of one agent type share its system prompt: where requests of other sessions
    run with it, a new one adds only its own part; where none do, the prompt too."""
    system = SharedPrefix(key=7, tokens=6_000, blocks=60)
    crowded = dict(num_gpu_blocks=1_000, in_flight_kv_tokens=6_000 + 3 * 2_000, hold_s=20.0)
    with_type = snap("a", prefix_kv={7: [3, 6_000]}, **crowded)
    without = snap("b", prefix_kv={8: [3, 6_000]}, **crowded)
    turn = req(tokens=8_000, hits={"a": 80, "b": 80}, session_id="s", shared_prefix=system)
    assert scorer().terms(turn, with_type).kv_wait_s == 0  # 12,000 + 2,000 fit in 16,000
    excess = 12_000 + 8_000 - 16_000
    assert scorer().terms(turn, without).kv_wait_s == pytest.approx(excess / 12_000 * 20.0)
    assert scorer().score(turn, [with_type, without])[0] == 1.0


def test_kv_wait_and_slot_wait_overlap() -> None:
    """Both are waits for admission, side by side: the longer one counts, not their sum."""
    full = snap("a", kv_usage=1.0, hold_s=20.0, slot_limit=4, running=4)
    terms = scorer().terms(req(tokens=8_000), full)
    assert terms.kv_wait_s == pytest.approx(1.0) and terms.slot_wait_s == pytest.approx(5.0)
    base = scorer(kv_wait_weight=0, slot_wait_weight=0).terms(req(tokens=8_000), full)
    assert terms.total_s == pytest.approx(base.total_s + 5.0)


def test_a_session_claims_its_whole_prompt_a_shared_prefix_only_what_it_computes() -> None:
    """A session's cached context is idle in the cache until it runs, then held; a request
    without a session most likely shares its cached prefix with others running."""
    session = req(tokens=8_000, hits={"a": 100}, session_id="s")
    single = req(tokens=8_000, hits={"a": 100})
    uncached = single.uncached_tokens("a")
    assert uncached < 8_000
    assert session.kv_claim(uncached) == 8_000 and single.kv_claim(uncached) == uncached
    # Its answer adds to the cache while it decodes; a prefill step's one token does not.
    answered = req(tokens=8_000, hits={"a": 100}, session_id="s", answer_tokens=300)
    assert answered.kv_claim(uncached) == 8_300 and answered.kv_own(uncached) == uncached + 300
    step = req(tokens=8_000, session_id="s", answer_tokens=300, prefill_step=True)
    assert step.kv_claim(uncached) == 8_000
    # Its context is cached at home, but another session's request holds most of that cache:
    # the turn waits there for room, and goes where it fits.
    home = snap("home", num_gpu_blocks=1_000, in_flight_kv_tokens=12_000, hold_s=10.0)
    other = snap("other", num_gpu_blocks=1_000, hold_s=10.0)
    turn = req(tokens=6_000, hits={"home": 90}, session_id="s", affinity_endpoint="home")
    assert scorer().terms(turn, home).kv_wait_s > 0
    assert scorer().score(turn, [home, other])[1] == 1.0
    assert scorer(kv_wait_weight=0).score(turn, [home, other])[0] == 1.0
    # A sub-agent of a session whose parent runs at home: the context is held there already.
    parent = snap(
        "home", num_gpu_blocks=1_000, in_flight_kv_tokens=12_000, hold_s=10.0,
        session_kv={"s": [1, 12_000, 300, 300]},
    )
    sub = req(tokens=12_100, hits={"home": 185}, session_id="s", affinity_endpoint="home")
    assert scorer().terms(sub, parent).kv_wait_s == 0
    assert scorer().score(sub, [parent, other])[0] == 1.0


def test_affinity_breaks_near_ties_and_calibration_is_used() -> None:
    s = scorer()
    scores = s.score(req(tokens=500, affinity_endpoint="b"), [snap("a"), snap("b")])
    assert scores[1] == 1.0 > scores[0]
    calibrator = Calibrator()
    for tokens in range(1_000, 20_000, 500):
        calibrator.observe("slow", tokens, 0.03 + 0.002 * tokens)  # ten times slower
        calibrator.observe("fast", tokens, 0.03 + 0.0002 * tokens)
    slow_aware = TTFTCostScorer(calibrator)
    scores = slow_aware.score(req(tokens=5_000, hits={"slow": 40}), [snap("slow"), snap("fast")])
    assert scores[1] == 1.0
    assert s.score(req(), []) == []


def test_recompute_weight_follows_the_queue_where_the_recompute_would_run() -> None:
    # A session placed at home: ~9,600 tokens of its own context cached there.
    request = req(tokens=10_000, hits={"home": 150}, session_id="s", affinity_endpoint="home")
    home = snap("home", pending_prefill_tokens=12_000, pending_prefill_requests=3)
    s = scorer(recompute_weight=1.0, recompute_weight_per_queued=0.1, recompute_weight_max=2.0,
               home_margin=0.0)
    # Nothing queued where the context would be recomputed: the recompute delays no one else,
    # so the longer queue at home decides.
    assert s.score(request, [home, snap("b")])[1] == 1.0
    # Five requests queued there: each would wait out the recompute too, so stay home.
    busy = snap("b", pending_prefill_tokens=1_000, pending_prefill_requests=5)
    assert s.terms(request, busy).prefill_s > s.terms(request, home).prefill_s
    assert s.score(request, [home, busy])[0] == 1.0
    # Requests another gateway sent count as queued; the weight stops at its maximum.
    foreign = s.terms(request, snap("b", waiting=5))  # 512 tokens assumed for each
    ours = snap("b", pending_prefill_tokens=5 * 512, pending_prefill_requests=5)
    assert foreign.prefill_s == pytest.approx(s.terms(request, ours).prefill_s)
    # Our own requests, in flight when the count was scraped and finished since, are no one's.
    stale = snap("b", waiting=5, scraped_in_flight=5)
    assert s.terms(request, stale).prefill_s == pytest.approx(s.terms(request, snap("b")).prefill_s)
    crowded = snap("b", pending_prefill_requests=1_000)
    uncapped = scorer(recompute_weight_per_queued=0.1, recompute_weight_max=8.0)
    assert s.terms(request, crowded).prefill_s < uncapped.terms(request, crowded).prefill_s
    assert scorer(recompute_weight=1.5, recompute_weight_per_queued=0, home_margin=0.0).score(
        request, [home, snap("b")]
    )[0] == 1.0  # a fixed weight 1.5 stays even when the other endpoint is idle


def test_a_recently_busy_endpoint_is_not_taken_for_an_idle_one() -> None:
    """Home drained a moment ago; its sessions come back after their think gaps."""
    request = req(tokens=10_000, hits={"home": 150})
    lull = snap("home", pending_prefill_tokens=0, recent_prefill_tokens=20_000)
    endpoints = [lull, snap("b")]
    assert scorer(recent_queue_weight=1.0).score(request, endpoints)[1] == 1.0
    assert scorer(recent_queue_weight=0.0).score(request, endpoints)[0] == 1.0
    # A queue longer now than of late counts as it is now.
    now = snap("home", pending_prefill_tokens=30_000, recent_prefill_tokens=1_000)
    assert scorer().terms(request, now).queued_tokens == 30_000


def test_terms_scale_with_the_endpoints_speed() -> None:
    # On hardware ten times faster every term priced in tokens, not only the prefill, is ten
    # times cheaper (the waits for room are measured in seconds on the endpoint itself).
    fast = Calibrator()
    for tokens in range(1_000, 20_000, 500):
        fast.observe("a", tokens, 0.003 + 0.00002 * tokens)
    slow_terms = scorer().terms(req(tokens=500), snap("a", in_flight=10, kv_usage=0.99))
    fast_terms = TTFTCostScorer(fast).terms(req(tokens=500), snap("a", in_flight=10, kv_usage=0.99))
    assert fast_terms.load_s == pytest.approx(slow_terms.load_s / 10, rel=0.05)


def test_evicting_cached_context_is_priced_only_when_the_cache_is_full() -> None:
    # 10,000 tokens, nothing cached anywhere; "full" must evict all but 10 blocks to take them.
    request = req(tokens=10_000, cache_room={"full": 10, "roomy": 10_000})
    s = scorer(eviction_weight=1.0)
    full, roomy = s.terms(request, snap("full")), s.terms(request, snap("roomy"))
    assert roomy.evicted_tokens == 0
    assert full.evicted_tokens == pytest.approx(10_000 - 10 * 64, abs=5)  # ~64 tokens a block
    assert full.total_s > roomy.total_s
    assert s.score(request, [snap("full"), snap("roomy")])[1] == 1.0


def test_only_live_sessions_context_is_worth_keeping() -> None:
    # 160,000 tokens of KV on each endpoint. "crowded" is home to live sessions whose contexts
    # fill it; "stale" is full of contexts no live session wants (the index sees it full).
    request = req(
        tokens=10_000, cache_room={"crowded": 0, "stale": 0},
        live_tokens={"crowded": 155_000, "stale": 20_000},
    )  # fmt: skip
    s = scorer()
    crowded, stale = s.terms(request, snap("crowded")), s.terms(request, snap("stale"))
    assert (crowded.evicted_tokens, stale.evicted_tokens) == (5_000, 0)
    assert s.score(request, [snap("crowded"), snap("stale")])[1] == 1.0
    # The index's view where the capacity is unknown, or when asked for.
    assert s.terms(request, snap("stale", num_gpu_blocks=None)).evicted_tokens > 9_000
    assert scorer(eviction_room="index").terms(request, snap("stale")).evicted_tokens > 9_000


def test_a_full_cache_keeps_a_session_home_longer() -> None:
    """Home holds the context but has a queue; moving would evict someone else's context."""
    hits = {"home": 140}  # 8,960 of 10,000 tokens cached at home
    queued = {"pending_prefill_tokens": 14_000}
    endpoints = [snap("home", **queued), snap("other")]
    session = {"session_id": "s", "affinity_endpoint": "home"}
    with_room = req(tokens=10_000, hits=hits, cache_room={"home": 10**6, "other": 10**6},
                    **session)
    full = req(tokens=10_000, hits=hits, cache_room={"home": 0, "other": 0}, **session)
    s = scorer()
    assert s.score(with_room, endpoints)[1] == 1.0, "caches with room: the queue decides, move"
    assert s.score(full, endpoints)[0] == 1.0, "full caches: moving costs an eviction, stay"


def test_a_shared_prefix_stays_where_it_is_cached_unless_moving_pays_for_the_copy() -> None:
    # No session (single-turn traffic on a shared document or system prompt): 8,960 of
    # 10,000 tokens held by "home", whose queue is as long as the whole prompt.
    request = req(tokens=10_000, hits={"home": 140})
    home, idle = snap("home", pending_prefill_tokens=10_000), snap("idle")
    s = scorer()
    terms = s.terms(request, idle)
    assert terms.copied_tokens == 8_960 and s.terms(request, home).copied_tokens == 0
    # Recomputing it on the idle replica is about as fast; the copy tips it: stay.
    assert scorer(copy_weight=0).score(request, [home, idle])[1] == 1.0
    assert s.score(request, [home, idle])[0] == 1.0
    # A real gain still moves it: the queue at home costs more than the recompute and a copy.
    long_queue = snap("home", pending_prefill_tokens=25_000)
    assert s.score(request, [long_queue, idle])[1] == 1.0
    # Where the idle replica's cache must evict to take it, the copy is that eviction, not
    # another on top of it.
    full = req(tokens=10_000, hits={"home": 140}, cache_room={"idle": 0})
    both = s.terms(full, idle)
    assert both.evicted_tokens > both.copied_tokens
    assert both.prefill_s == pytest.approx(
        scorer(copy_weight=0).terms(full, idle).prefill_s)
    # A session's context is its own, and its first request's placement is the placement
    # term's to price: neither is charged a copy.
    placed = req(tokens=10_000, hits={"home": 140}, session_id="s", affinity_endpoint="home")
    first = req(tokens=10_000, hits={"home": 140}, session_id="new", later_requests=8.0)
    assert s.terms(placed, idle).copied_tokens == s.terms(first, idle).copied_tokens == 0
    assert s.score(first, [home, idle])[1] == 1.0


def test_a_holder_the_filters_left_out_charges_no_copy() -> None:
    # A prefill-only endpoint holds the prefix; the decode pick chooses between two endpoints
    # that hold none of it: neither can be spared the recompute, so neither pays a copy.
    request = req(tokens=10_000, hits={"prefiller": 140})
    busy, idle = snap("busy", pending_prefill_tokens=2_000), snap("idle")
    s = scorer()
    assert s.score(request, [busy, idle]) == scorer(copy_weight=0).score(request, [busy, idle])
    assert s.score(request, [busy, idle])[1] == 1.0


def test_a_full_engine_costs_the_wait_for_a_slot_whatever_it_holds() -> None:
    # A shared prompt held by "home", whose 16 slots are all taken by answers that each hold
    # one for 3 s: one slot frees about every 0.19 s.
    request = req(tokens=4_000, hits={"home": 56})
    idle = snap("idle")

    def home(in_flight: int) -> EndpointSnapshot:
        return snap("home", in_flight=in_flight, slot_limit=16, hold_s=3.0)

    s = scorer()
    assert s.terms(request, home(15)).slot_wait_s == 0.0, "a slot is free"
    assert s.terms(request, home(16)).slot_wait_s == pytest.approx(3.0 / 16)
    assert s.terms(request, home(20)).slot_wait_s == pytest.approx(5 * 3.0 / 16)
    assert s.score(request, [home(16), idle])[0] == 1.0, "one slot's wait beats the recompute"
    assert s.score(request, [home(24), idle])[1] == 1.0, "nine slots' wait does not"
    unknown = snap("home", in_flight=20, hold_s=3.0)
    assert s.terms(request, unknown).slot_wait_s == 0.0, "no limit learned, no wait priced"
    assert scorer(slot_wait_weight=0).terms(request, home(20)).slot_wait_s == 0.0
    # Strangers' requests, running or waiting in the scrape, take slots too.
    crowded = snap("home", running=16, waiting=3, slot_limit=16, hold_s=3.0)
    assert s.terms(request, crowded).slot_wait_s == pytest.approx(4 * 3.0 / 16)


def test_explain_reports_every_term() -> None:
    request = req(tokens=1_000, cache_room={"a": 0})
    terms = scorer().explain(request, snap("a", in_flight=2, pending_prefill_requests=3))
    assert terms["evicted_tokens"] == terms["uncached_tokens"] == 1_000
    assert terms["recompute_weight"] == pytest.approx(1.3)
    assert terms["speed_factor"] == 1.0  # no samples: the fleet's figures
    assert terms["predicted_ttft_s"] == pytest.approx(
        terms["prefill_s"] + terms["load_s"] + max(terms["kv_wait_s"], terms["slot_wait_s"])
    )
    assert terms["priced_s"] == pytest.approx(terms["predicted_ttft_s"] + terms["horizon_s"])
    # The wait for KV room, with what it was reckoned from.
    full = snap(
        "a", kv_usage=0.5, scraped_kv_tokens=20_000, in_flight_kv_tokens=150_000, hold_s=20.0
    )
    kv = scorer().explain(req(tokens=8_000), full)
    held = 150_000 + 0.5 * kv["kv_capacity_tokens"] - 20_000
    assert (kv["kv_held_tokens"], kv["kv_claim_tokens"], kv["hold_s"]) == (held, 8_000, 20.0)
    excess = held + 8_000 - kv["kv_capacity_tokens"]
    assert kv["kv_wait_s"] == pytest.approx(
        excess / min(held, kv["kv_capacity_tokens"]) * 20.0
    )
    # At a home holding the context the price is discounted; the prediction reported stays
    # the prediction.
    session = req(tokens=1_024, hits={"a": 16}, session_id="s", affinity_endpoint="a")
    home = scorer(home_margin=0.2, affinity_bonus_tokens=0).explain(session, snap("a"))
    assert home["priced_s"] == pytest.approx(0.8 * home["predicted_ttft_s"], rel=1e-3)


def test_precise_prefix_source_prices_what_the_events_say() -> None:
    request = req(tokens=10_000, hits={"a": 150})  # the approximate index: all on "a"
    endpoints = [snap("a"), snap("b")]
    params = TTFTCostParameters(prefix_source="precise")
    precise = TTFTCostScorer(Calibrator(), params, FixedScores([0.0, 0.9]))
    assert precise.score(request, endpoints)[1] == 1.0, "the events say b holds 90%"
    assert precise.explain(request, endpoints[1])["uncached_tokens"] == 1_000
    untokenized = TTFTCostScorer(Calibrator(), params, FixedScores(None))
    assert untokenized.score(req(tokens=10_000, hits={"a": 150}), endpoints)[0] == 1.0
    approximate = TTFTCostScorer(Calibrator(), TTFTCostParameters(), FixedScores([0.0, 0.9]))
    assert approximate.score(request, endpoints)[0] == 1.0, "approximate by default"


def test_precise_prefix_source_turns_precise_routing_on() -> None:
    pool = {"endpoints": [{"url": "http://127.0.0.1:9"}]}
    profile = {"name": "p", "plugins": [{"pluginRef": "ttft-cost-scorer"}]}
    for source, on in (("precise", True), ("approximate", False)):
        config = parse_config({
            "pool": pool,
            "plugins": [{"type": "ttft-cost-scorer", "parameters": {"prefixSource": source}}],
            "schedulingProfiles": [profile],
        })
        assert precise_enabled(config, config.plugins or []) is on


def test_a_fleet_whose_queues_cost_nothing_keeps_sessions_home() -> None:
    # Prefills that run side by side (llm-d-inference-sim): the queue at home does not delay
    # this request, so the session stays where its context is, where with vLLM's queueing it
    # would move; running requests, which slow everything there, are priced dearer instead.
    side_by_side = _calibrated(
        lambda own, _queued, running, _requests: (0.03 + 0.0002 * own) * (1 + running / 15)
    )
    request = req(tokens=10_000, hits={"home": 150})
    endpoints = [snap("home", pending_prefill_tokens=40_000), snap("b")]
    assert scorer().score(request, endpoints)[1] == 1.0
    assert TTFTCostScorer(side_by_side).score(request, endpoints)[0] == 1.0
    busy = snap("a", in_flight=12)
    prior_load = scorer().terms(req(tokens=500), busy).load_s
    assert TTFTCostScorer(side_by_side).terms(req(tokens=500), busy).load_s > 3 * prior_load


def test_where_each_prefill_pays_its_own_fixed_cost_a_burst_queued_ahead_costs_more() -> None:
    # Eight sub-agents of 150 tokens queued on one endpoint, a single 1,200-token request on
    # the other: the same tokens, but where every prefill pays a fixed cost of its own (the
    # first bytes show it), the burst is the longer wait.
    own_costs = _calibrated(
        lambda own, queued, running, requests: 0.03 * (1 + requests)
        + 0.0002 * (own + queued) + 0.008 * running
    )
    burst = snap("burst", pending_prefill_tokens=1_200, pending_prefill_requests=8, in_flight=8)
    single = snap("single", pending_prefill_tokens=1_200, pending_prefill_requests=1, in_flight=8)
    request = req(tokens=2_000)
    learned = TTFTCostScorer(own_costs)

    def gap(cost: TTFTCostScorer) -> float:
        return cost.terms(request, burst).total_s - cost.terms(request, single).total_s

    # With vLLM's shared steps (the prior) a queued request costs its tokens, and the gap is
    # the recompute weight's alone.
    per_request = own_costs.fleet_price().per_queued_request_s
    assert per_request == pytest.approx(0.03, rel=0.3)
    assert gap(learned) - gap(scorer()) == pytest.approx(7 * per_request, rel=0.1)
    assert learned.score(request, [burst, single])[1] == 1.0


def _calibrated(seconds: Callable[[float, float, int, int], float]) -> Calibrator:
    """A calibrator fed 400 first bytes from four replicas under spread-out load: ``seconds``
    of (own tokens, queued tokens, running requests, queued requests)."""
    calibrator = Calibrator()
    rng = random.Random(9)
    for i in range(400):
        own, running = rng.uniform(50, 8_000), rng.randint(0, 15)
        queued = rng.choice([0.0, rng.uniform(0, 20_000)])
        requests = rng.randint(1, 8) if queued else 0
        took = seconds(own, queued, running, requests)
        calibrator.observe(f"e{i % 4}", own, took, queued, running, requests)
    return calibrator


def test_a_new_session_is_placed_by_the_queue_its_later_requests_will_meet() -> None:
    s = scorer()
    # A new session whose 3,360-token system prompt the busy replica holds: its last seconds'
    # queue averaged 800 tokens, the other replica's nothing.
    endpoints = [snap("holder", recent_prefill_tokens=800.0), snap("empty")]
    first = req(tokens=3_680, hits={"holder": 210})
    assert s.score(first, endpoints)[0] == 1.0  # one request: the cache hit wins
    placing = req(tokens=3_680, hits={"holder": 210}, later_requests=17.0)
    assert s.score(placing, endpoints)[1] == 1.0  # a whole session: the queue it meets wins
    terms = s.terms(placing, endpoints[0])
    per_queued = Calibrator().price("holder").per_queued_token_s
    assert terms.horizon_s == pytest.approx(17.0 * 800.0 * per_queued)
    assert s.terms(placing, endpoints[1]).horizon_s == 0
    # A short queue is not worth recomputing the prompt for, and the weight turns it off.
    calm = [snap("holder", recent_prefill_tokens=50.0), snap("empty")]
    assert s.score(placing, calm)[0] == 1.0
    assert scorer(placement_horizon_weight=0.0).score(placing, endpoints)[0] == 1.0
    assert "horizon_s" in s.explain(placing, endpoints[0])


@pytest.mark.parametrize("value", ["2", "2.0", True])
def test_parameters_are_not_coerced_from_another_type(value: object) -> None:
    # Built from a plugin's YAML parameters, which already give numbers their types.
    with pytest.raises(ValidationError) as info:
        TTFTCostParameters.model_validate({"recomputeWeight": value})
    assert info.value.errors()[0]["loc"] == ("recomputeWeight",)


def test_parameters_take_an_int_for_a_float_and_a_literal_from_a_string() -> None:
    params = TTFTCostParameters.model_validate({"recomputeWeight": 2, "evictionRoom": "index"})
    assert (params.recompute_weight, params.eviction_room) == (2.0, "index")


def home_with(queued: int) -> EndpointSnapshot:
    return snap("home", pending_prefill_tokens=queued, pending_prefill_requests=1)


def queue_slowing_home(
    s: TTFTCostScorer, request: RoutingRequest, factor: float, step: int = 50
) -> int:
    """The least queue at home (in ``step`` tokens) that prices it over ``factor`` times an
    idle endpoint "b"."""
    other = s.terms(request, snap("b")).total_s
    return next(
        q for q in range(0, 20_000, step)
        if s.terms(request, home_with(q)).total_s > factor * other
    )


def test_a_session_leaves_home_only_for_an_endpoint_predicted_clearly_faster() -> None:
    # A session whose context is cached at home, with a queue there; elsewhere nothing is
    # cached but nothing waits. Prices are the calibrator's priors for every endpoint.
    request = req(tokens=2_000, hits={"home": 30}, session_id="s", affinity_endpoint="home")
    plain = scorer(home_margin=0.0)
    other = snap("b")
    # A queue at home that makes it a little slower than recomputing elsewhere (10%).
    queued = queue_slowing_home(plain, request, 1.1)
    home = home_with(queued)
    assert plain.score(request, [home, other])[1] == 1.0  # without the margin, it moves
    margin = scorer(home_margin=0.2)
    assert margin.score(request, [home, other])[0] == 1.0  # 10% faster is not enough
    held = 30 * 256 / 8_000  # the margin is kept for the share of the prompt held at home
    assert margin.terms(request, home).home_margin == pytest.approx(0.2 * held)
    assert margin.terms(request, other).home_margin == 0.0  # only the home has it
    # Clearly slower at home (over 1 / 0.8 of elsewhere): it moves.
    far = snap("home", pending_prefill_tokens=4 * queued, pending_prefill_requests=1)
    assert plain.terms(request, far).total_s > 1.3 * plain.terms(request, other).total_s
    assert margin.score(request, [far, other])[1] == 1.0
    # A request without a session has no home to keep.
    anonymous = req(tokens=2_000, hits={"home": 30})
    assert margin.terms(anonymous, home).home_margin == 0.0
    assert margin.explain(request, home)["home_margin"] == pytest.approx(0.2 * held)


def test_a_home_that_lost_the_context_keeps_the_margin_only_for_what_it_holds() -> None:
    margin = scorer(home_margin=0.2, affinity_bonus_tokens=0)
    plain = scorer(home_margin=0.0, affinity_bonus_tokens=0)
    lost = req(tokens=2_048, session_id="s", affinity_endpoint="home")  # evicted, or restarted
    half = req(tokens=2_048, hits={"home": 16}, session_id="s", affinity_endpoint="home")
    assert margin.terms(lost, snap("home")).home_margin == 0.0
    assert margin.terms(half, snap("home")).home_margin == pytest.approx(0.1)
    # Home holds nothing and is a little slower (a short queue): nothing keeps the session
    # there, so it goes where it is predicted faster, as with no margin at all.
    other = snap("b")
    queued = queue_slowing_home(plain, lost, 1.05)
    assert margin.score(lost, [home_with(queued), other])[1] == 1.0
    # A home holding the whole context keeps the full margin: with the context cached on both
    # endpoints, a queue that makes home a little slower moves the session only without it.
    kept = req(
        tokens=2_048, hits={"home": 32, "b": 32}, session_id="s", affinity_endpoint="home"
    )
    assert margin.terms(kept, snap("home")).home_margin == pytest.approx(0.2, rel=1e-3)
    queued = queue_slowing_home(plain, kept, 1.05, step=1)
    assert plain.score(kept, [home_with(queued), other])[1] == 1.0
    assert margin.score(kept, [home_with(queued), other])[0] == 1.0
