from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.estimators.calibration import Calibrator, CostPriors
from tests.manual_clock import ManualClock


def test_priors_until_samples_arrive() -> None:
    calibrator = Calibrator(CostPriors(overhead_s=0.03, per_token_s=0.0002))
    assert calibrator.cost("a") == (0.03, 0.0002)
    assert calibrator.predict("a", 1000) == pytest.approx(0.23)


def test_learns_a_slower_endpoint_and_exports_it() -> None:
    registry = CollectorRegistry()
    calibrator = Calibrator(registry=registry)
    rng = random.Random(1)
    for _ in range(300):
        tokens = rng.uniform(100, 20_000)
        # Twice the prior per token, 50 ms overhead, a little noise.
        calibrator.observe("slow", tokens, 0.05 + 0.0004 * tokens + rng.gauss(0, 0.005))
    overhead, per_token = calibrator.cost("slow")
    assert per_token == pytest.approx(0.0004, rel=0.05)
    assert overhead == pytest.approx(0.05, abs=0.01)
    # An endpoint without samples of its own starts from what the fleet learned.
    assert (
        calibrator.cost("other")
        == calibrator.fleet_cost()
        != (CostPriors().overhead_s, CostPriors().per_token_s)
    )
    assert calibrator.fleet_cost()[1] == pytest.approx(0.0004, rel=0.05)
    text = generate_latest(registry).decode()
    assert 'prefixgate_calibrated_prefill_seconds_per_token{endpoint="slow"}' in text
    assert "prefixgate_calibrated_fleet_prefill_seconds_per_token 0.000" in text


def test_outliers_are_clipped_and_the_fit_bounded() -> None:
    calibrator = Calibrator()
    rng = random.Random(2)
    for i in range(200):
        tokens = rng.uniform(100, 10_000)
        stall = 120.0 if i % 50 == 0 else 0.0  # a rare two-minute stall must not wreck the fit
        calibrator.observe("a", tokens, 0.03 + 0.0002 * tokens + stall)
    _, per_token = calibrator.cost("a")
    assert per_token == pytest.approx(0.0002, rel=0.25)
    for _ in range(50):
        calibrator.observe("b", 1000, 0.0)  # impossible speed: the fit stays within bounds
    overhead, per_token = calibrator.cost("b")
    assert overhead >= 0.0 and per_token >= CostPriors().per_token_s / 100


def test_recent_samples_win() -> None:
    calibrator = Calibrator()
    rng = random.Random(3)
    for _ in range(200):
        tokens = rng.uniform(100, 10_000)
        calibrator.observe("a", tokens, 0.03 + 0.0002 * tokens)
    for _ in range(300):  # the replica got three times slower
        tokens = rng.uniform(100, 10_000)
        calibrator.observe("a", tokens, 0.03 + 0.0006 * tokens)
    assert calibrator.cost("a")[1] == pytest.approx(0.0006, rel=0.1)


def test_constant_token_counts_keep_the_prior_slope_and_garbage_is_ignored() -> None:
    calibrator = Calibrator(clock=lambda: 0.0)
    for _ in range(100):
        calibrator.observe("a", 500, 0.2)
    overhead, per_token = calibrator.cost("a")
    assert per_token == pytest.approx(CostPriors().per_token_s, rel=1e-6)
    assert overhead + per_token * 500 == pytest.approx(0.2, rel=0.05)
    calibrator.observe("a", float("nan"), 1.0)
    calibrator.observe("a", 10, -1.0)
    assert calibrator.cost("a") == (overhead, per_token)
    calibrator.forget("a")  # it left the pool: the fleet keeps what it taught
    assert calibrator.cost("a") == calibrator.fleet_cost()


def test_prompts_of_nearly_one_size_do_not_make_tokens_free() -> None:
    # Short prompts of about one size, first bytes jittered by a busy loop: the times carry
    # no information about the cost of a token. A slope fitted to that noise alone collapsed
    # to the floor, and with it the price of every queued and running token on the endpoint:
    # all traffic herded onto it while the others stood idle.
    calibrator = Calibrator()
    rng = random.Random(4)
    for _ in range(300):
        tokens = rng.uniform(40, 80)
        seconds = 0.02 + rng.uniform(0.0, 0.03) - 0.0003 * (tokens - 60)  # noise trending down
        calibrator.observe("a", tokens, seconds)
    overhead, per_token = calibrator.cost("a")
    assert per_token == pytest.approx(CostPriors().per_token_s, rel=0.2)
    assert overhead + per_token * 60 == pytest.approx(0.035, abs=0.01)


def fast_replica(calibrator: Calibrator, endpoint: str, rng: random.Random) -> None:
    """A first byte from a replica eight times faster than the prior, as the gateway timed it
    on the simulator at --speed 2 (four times faster prefill, half the wall-clock time)."""
    tokens = rng.uniform(200, 6_000)
    calibrator.observe(endpoint, tokens, 0.005 + 0.000025 * tokens + rng.uniform(0, 0.004))


def test_a_replica_priced_out_by_a_cold_start_burst_comes_back() -> None:
    # Seen in a run: at a cold start the first 8 requests all went to one replica at once and
    # waited for each other, so later-sent ones answered sooner; fitted alone, that replica
    # learned a quarter-second overhead, was priced out of all traffic, and never got the
    # samples that would have corrected it (8 requests of 856 while others served 200).
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    for i in range(8):
        calibrator.observe("unlucky", 3_583 + 319 * i, 0.2747 - 0.003 * i)
    rng = random.Random(5)
    for _ in range(100):
        for endpoint in ("b", "c", "d"):
            fast_replica(calibrator, endpoint, rng)
    fleet = calibrator.predict("b", 3_700)
    # Its own few samples weigh little against what the fleet learned...
    assert calibrator.predict("unlucky", 3_700) < 1.6 * fleet
    # ...and fade while it gets no traffic: it is soon priced like its peers.
    clock.now += 120.0
    assert calibrator.predict("unlucky", 3_700) == pytest.approx(fleet, rel=0.1)


@pytest.mark.parametrize("actual_per_token", [0.0001, 0.0004])
def test_a_young_fit_prices_the_only_endpoint_seen_like_the_others(
    actual_per_token: float,
) -> None:
    # Identical idle replicas, prompts of one size (single-turn traffic on shared prefixes), and
    # hardware twice as fast (or slow) as the priors say. After a few first bytes from "seen"
    # the fleet price still leans on the priors; judged against that, "seen" looked faster (or
    # slower) than "unseen" and took (or lost) every request that found no cached prefix.
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    for _ in range(5):
        clock.now += 1.0
        calibrator.observe("seen", 1_908, 0.03 + actual_per_token * 1_908)
    assert calibrator.factor("seen") == pytest.approx(1.0, abs=0.02)
    assert calibrator.predict("seen", 1_908) == pytest.approx(
        calibrator.predict("unseen", 1_908), rel=0.02)
    # Among endpoints seen, a slower one is still told apart.
    for _ in range(20):
        clock.now += 1.0
        calibrator.observe("slow", 1_908, 0.03 + 3 * actual_per_token * 1_908)
        calibrator.observe("seen", 1_908, 0.03 + actual_per_token * 1_908)
    assert calibrator.factor("slow") > 1.2 and calibrator.factor("seen") < 0.9


def test_a_truly_slower_replica_stays_slower() -> None:
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    rng = random.Random(6)
    for _ in range(300):
        clock.now += 0.05
        tokens = rng.uniform(100, 10_000)
        calibrator.observe("fast", tokens, 0.03 + 0.0002 * tokens)
        tokens = rng.uniform(100, 10_000)
        calibrator.observe("slow", tokens, 0.03 + 0.0006 * tokens)
    assert calibrator.cost("slow")[1] > 1.8 * calibrator.cost("fast")[1]
    assert 0.0002 < calibrator.fleet_cost()[1] < 0.0006


def _first_bytes(calibrator: Calibrator, world: str, samples: int = 400) -> None:
    """First bytes from four replicas, with queues and running counts spread as under load."""
    rng = random.Random(7)
    for i in range(samples):
        own = rng.uniform(50, 8_000)
        running = rng.randint(0, 15)
        queued = rng.choice([0.0, 0.0, rng.uniform(0, 20_000)])
        requests = rng.randint(1, 8) if queued else 0
        if world == "batched":  # vLLM: prefills queue in shared steps
            seconds = 0.03 + 0.0002 * (own + queued) + 0.008 * running
        elif world == "own-overheads":  # every prefill pays its fixed cost, queued ones too
            seconds = 0.03 * (1 + requests) + 0.0002 * (own + queued) + 0.008 * running
        else:  # llm-d-inference-sim: side by side, scaled by the load factor
            seconds = (0.03 + 0.0002 * own) * (1 + running / 15)
        seconds += rng.gauss(0, 0.01)
        calibrator.observe(f"e{i % 4}", own, seconds, queued, running, requests)


def test_a_batched_fleet_keeps_the_priors_shape() -> None:
    calibrator = Calibrator()
    _first_bytes(calibrator, "batched")
    price = calibrator.fleet_price()
    assert price.per_token_s == pytest.approx(0.0002, rel=0.05)
    assert price.per_queued_token_s == pytest.approx(0.0002, rel=0.05)
    assert price.per_running_s == pytest.approx(0.008, rel=0.15)
    assert price.overhead_s == pytest.approx(0.03, abs=0.01)
    assert price.per_queued_request_s < 0.005, "a queued request costs its tokens only"


def test_prefills_with_fixed_costs_of_their_own_price_each_queued_request() -> None:
    registry = CollectorRegistry()
    calibrator = Calibrator(registry=registry)
    _first_bytes(calibrator, "own-overheads")
    price = calibrator.fleet_price()
    assert price.per_queued_request_s == pytest.approx(0.03, rel=0.25)
    assert price.per_queued_token_s == pytest.approx(0.0002, rel=0.1)
    assert price.overhead_s == pytest.approx(0.03, abs=0.01)
    text = generate_latest(registry).decode()
    assert "prefixgate_calibrated_fleet_prefill_seconds_per_queued_request" in text


def test_side_by_side_prefills_learn_free_queues_and_dear_running_requests() -> None:
    registry = CollectorRegistry()
    calibrator = Calibrator(registry=registry)
    _first_bytes(calibrator, "independent")
    price = calibrator.fleet_price()
    # A queued token costs next to nothing, a running request several times the prior's 8 ms.
    assert price.per_queued_token_s < 0.1 * price.per_token_s
    assert price.per_running_s > 3 * 0.008
    assert price.per_token_s == pytest.approx(0.0002 * 1.5, rel=0.3)  # the mean load factor
    text = generate_latest(registry).decode()
    assert "prefixgate_calibrated_fleet_prefill_seconds_per_queued_token" in text
    assert "prefixgate_calibrated_fleet_prefill_seconds_per_running_request" in text


def test_no_spread_in_queues_or_running_counts_keeps_their_priors() -> None:
    calibrator = Calibrator()
    rng = random.Random(8)
    for _ in range(300):
        tokens = rng.uniform(100, 10_000)
        calibrator.observe("a", tokens, 0.05 + 0.0004 * tokens, queued=0.0, running=3.0)
    price = calibrator.price("a")
    assert price.per_token_s == pytest.approx(0.0004, rel=0.05)
    # Not identifiable from these samples: the prior's shape at the learned speed.
    assert price.per_queued_token_s == pytest.approx(price.per_token_s, rel=0.01)
    assert price.per_running_s == pytest.approx(40 * price.per_token_s, rel=0.05)
    assert price.per_queued_request_s == 0.0


def test_a_free_queue_does_not_make_prompts_of_one_size_free() -> None:
    """A burst of first requests, all one size, on prefills that run side by side: the queue
    shows free, but nothing says what an own token costs, so its price stays the prior's."""
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    rng = random.Random(9)
    for _ in range(40):
        clock.now += 0.01
        queued = rng.uniform(0, 1_300)
        calibrator.observe("a", 675, 0.31 + rng.gauss(0, 0.005), queued, 0.0, queued // 300)
    clock.now += 1.0
    price = calibrator.fleet_price()
    assert price.per_token_s == pytest.approx(0.0002, rel=0.1)
    # What sends a session's next request home: 593 tokens fewer to compute there.
    assert price.predict(815) - price.predict(222) > 0.1
    # The samples are predicted where they were taken, whatever the split.
    assert price.predict(675, 650, 0.0, 2) == pytest.approx(0.31, abs=0.02)


def test_a_dear_queue_on_prompts_of_one_size_is_learned_as_the_queues_price() -> None:
    """A fleet four times slower than the prior, prompts all one size, queues that cost what
    own tokens cost: the queue's price is learned from the queues, not capped at the own
    token's (the prior's, here), which left 1.6 s of overhead for an empty queue's 0.57 s."""
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    rng = random.Random(10)
    for _ in range(300):
        clock.now += 0.01
        queued = rng.uniform(0, 3_000)
        calibrator.observe("a", 675, 0.03 + 0.0008 * (675 + queued), queued)
    clock.now += 1.0
    price = calibrator.fleet_price()
    # Pulled towards the prior as far as 3,000 tokens of queue spread leave it (about half).
    assert price.per_queued_token_s > 2 * 0.0002
    assert price.predict(675, 1_500) == pytest.approx(0.03 + 0.0008 * 2_175, rel=0.05)
    # 0.57 s true; 1.6 s with the queued price capped at the own one's.
    assert price.predict(675) < 1.2


def test_a_price_held_at_its_bound_leaves_the_rest_to_the_others() -> None:
    """Every queued request 300 tokens: the fit cannot tell a queued token from a queued
    request, and the unbounded request price is negative. Held at 0 with the queued price
    solved again, the queue is priced near what it costs; clamped after the solve, the
    queued price kept the share that offset the negative one."""
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    rng = random.Random(11)
    for _ in range(300):
        clock.now += 0.01
        own, requests = rng.uniform(100, 5_000), rng.randint(0, 10)
        seconds = 0.03 + 0.0002 * own + 0.00005 * 300 * requests
        calibrator.observe("a", own, seconds, 300.0 * requests, 0.0, requests)
    clock.now += 1.0
    price = calibrator.fleet_price()
    assert price.per_queued_request_s == 0.0
    assert price.per_queued_token_s < 0.00016  # 0.00019 clamped after the solve


def test_new_priors_solve_the_fit_again() -> None:
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    for _ in range(40):
        calibrator.observe("a", 500, 0.2)  # one prompt size: the slope is the prior's
    assert calibrator.fleet_price().per_token_s == pytest.approx(0.0002)
    calibrator.priors = CostPriors(per_token_s=0.0004)
    assert calibrator.fleet_price().per_token_s == pytest.approx(0.0004)


def test_the_fit_is_solved_when_read_at_most_every_interval_or_batch_of_samples() -> None:
    from router.estimators.calibration import REFIT_INTERVAL_S, REFIT_SAMPLES

    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    calibrator.observe("a", 1000, 5.0)
    first = calibrator.fleet_cost()  # the first sample is learned at once
    assert first != Calibrator().fleet_cost()
    for _ in range(REFIT_SAMPLES - 2):  # within the interval: the fit read stays as it was
        calibrator.observe("a", 1000, 5.0)
    assert calibrator.fleet_cost() == first
    clock.now += REFIT_INTERVAL_S  # the interval passed: solved on this read
    second = calibrator.fleet_cost()
    assert second != first
    for _ in range(REFIT_SAMPLES):  # a whole batch of samples: solved without waiting
        calibrator.observe("a", 1000, 5.0)
    assert calibrator.fleet_cost() != second


def test_evidence_faded_while_an_endpoint_was_quiet_stays_faded_at_its_next_sample() -> None:
    # A replica slow for a while (a stall, a cold start) is priced out; while it gets no
    # traffic its old samples fade and it is priced like its peers again. Its next first
    # byte, at the fleet's speed, brought all that old evidence back at full weight: priced
    # out again by samples ten minutes old, it never got the traffic to unlearn them.
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    rng = random.Random(12)

    def first_byte(endpoint: str, slowness: float) -> None:
        tokens = rng.uniform(200, 6_000)
        calibrator.observe(endpoint, tokens, slowness * (0.03 + 0.0002 * tokens))

    for _ in range(200):
        clock.now += 0.05
        for endpoint in ("b", "c", "d"):
            first_byte(endpoint, 1.0)
        first_byte("x", 8.0)
    assert calibrator.factor("x") > 3.0
    clock.now += 600.0
    assert calibrator.factor("x") == pytest.approx(1.0, abs=0.01)
    first_byte("x", 1.0)
    assert calibrator.factor("x") < 1.1


def test_a_probed_endpoint_starts_at_its_probes_ratio_to_the_fleets_median() -> None:
    registry = CollectorRegistry()
    calibrator = Calibrator(registry=registry)
    calibrator.probed("a", 0.02)
    # A lone probe compares with nothing.
    assert calibrator.factor("a") == 1.0
    calibrator.probed("b", 0.02)
    calibrator.probed("slow", 0.06)
    assert calibrator.factor("slow") == pytest.approx(3.0)
    assert calibrator.factor("a") == calibrator.factor("b") == pytest.approx(1.0)
    assert calibrator.cost("slow")[1] == pytest.approx(3 * calibrator.cost("a")[1])
    # Unprobed endpoints, and probes that measured nothing, keep the fleet's price.
    calibrator.probed("never", float("nan"))
    calibrator.probed("never", 0.0)
    assert calibrator.factor("never") == 1.0
    text = generate_latest(registry).decode()
    assert 'prefixgate_speed_probe_seconds{endpoint="slow"} 0.06' in text
    assert 'endpoint="never"' not in text
    # An endpoint that left takes its probe along: the median is the others' again.
    calibrator.forget("slow")
    assert 'endpoint="slow"' not in generate_latest(registry).decode()
    calibrator.probed("c", 0.04)
    assert calibrator.factor("c") == pytest.approx(2.0)


def test_first_bytes_outweigh_a_probe_that_was_wrong() -> None:
    clock = ManualClock()
    calibrator = Calibrator(clock=clock)
    for endpoint, seconds in (("a", 0.02), ("b", 0.02), ("c", 0.02), ("d", 0.08)):
        calibrator.probed(endpoint, seconds)
    assert calibrator.factor("d") == pytest.approx(4.0)
    rng = random.Random(3)
    for _ in range(200):  # d is as fast as the others after all (its probe met a stall)
        clock.now += 0.05
        for endpoint in "abcd":
            tokens = rng.uniform(100, 10_000)
            calibrator.observe(endpoint, tokens, 0.03 + 0.0002 * tokens)
    assert calibrator.factor("d") == pytest.approx(1.0, abs=0.1)
    # Its own first bytes weigh w / (w + endpointPseudoSamples) against the probe.
    fresh = Calibrator(clock=clock)
    for endpoint, seconds in (("a", 0.02), ("b", 0.02), ("d", 0.08)):
        fresh.probed(endpoint, seconds)
    before = fresh.factor("d")
    for _ in range(5):
        for endpoint in "abd":
            fresh.observe(endpoint, 1000, 0.03 + 0.0002 * 1000)
    assert 1.0 < fresh.factor("d") < before
