"""The learned per-endpoint concurrency limits and the detector built on them."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from flow_control.config import ConcurrencyLimitConfig, FlowControlConfig, SaturationDetectorConfig
from flow_control.controller import FlowController
from flow_control.limits import ConcurrencyLimits, ConcurrencySaturationDetector
from flow_control.request import FlowRequest
from router.core.endpoints import EndpointSnapshot
from tests.snapshots import snap as base_snap

CFG = ConcurrencyLimitConfig(initial_limit=8, min_limit=1, max_limit=32, tolerance=2.0)


def snap(
    eid: str = "a", *, pending: int = 0, in_flight: int | None = None, age: float = 0.05,
    **kw: Any,
) -> EndpointSnapshot:
    """``pending`` requests of ours waiting for a first byte (in flight too, unless given)."""
    return base_snap(
        eid, pending_prefill_requests=pending, pending_prefill_tokens=100 * pending,
        in_flight=pending if in_flight is None else in_flight, metrics_age=age, **kw,
    )  # fmt: skip


def test_limit_shrinks_when_first_bytes_slow_down_and_never_below_the_minimum() -> None:
    limits = ConcurrencyLimits(CFG)
    for _ in range(5):
        limits.observe("a", 1.0, 2)
    assert limits.limit("a") == 8, "at the baseline nothing changes while the limit is unused"
    for _ in range(200):
        limits.observe("a", 6.0, 8)  # 6x the best ratio seen, tolerance 2x
    assert limits.limit("a") == CFG.min_limit
    for _ in range(300):
        limits.observe("a", 6.0, 0)  # the replica is just slower now, even with no queue
    assert limits.limit("a") > CFG.min_limit, "samples with no queue re-learn the baseline"


def test_limit_grows_only_when_it_was_what_bound() -> None:
    limits = ConcurrencyLimits(CFG)
    assert not limits.observe("a", 1.0, 0)
    assert limits.limit("a") == 8
    assert limits.observe("a", 1.0, 7), "sent at the limit, first byte on time: grow"
    assert limits.limit("a") == 9
    for _ in range(100):
        limits.observe("a", 1.0, 100)
    assert limits.limit("a") == CFG.max_limit


def test_a_limit_cut_to_a_fraction_grows_back_once_first_bytes_recover() -> None:
    limits = ConcurrencyLimits(CFG)
    detector = ConcurrencySaturationDetector(limits, staleness=1.0)
    limits.observe("a", 1.0, 0)
    for _ in range(3):
        limits.observe("a", 10.0, 7)  # a slow spell cuts 8 to a fraction (6.1)
    cut = limits.limit("a")
    assert cut < CFG.initial_limit
    for _ in range(50):
        # Sent as the gateway sends: while the detector has room; every first byte ideal.
        sent = 0
        while not detector.saturated([snap(pending=sent)]):
            sent += 1
        for queued_at_send in range(sent):
            limits.observe("a", 1.0, queued_at_send)
    assert limits.limit("a") > cut, "a request sent at the room it had proves the limit bound"


def test_slow_but_steady_replica_keeps_its_limit() -> None:
    """Only a rise against the endpoint's own baseline counts, not slowness itself."""
    limits = ConcurrencyLimits(CFG)
    for _ in range(50):
        limits.observe("slow", 40.0, 8)
    assert limits.limit("slow") >= CFG.initial_limit


def test_nonsense_ratios_are_ignored() -> None:
    limits = ConcurrencyLimits(CFG)
    for bad in (math.inf, math.nan, 0.0, -1.0):
        assert not limits.observe("a", bad, 8)
    assert limits.limit("a") == 8 and list(limits.items()) == []


def test_detector_saturates_only_when_every_endpoint_is_at_its_limit() -> None:
    detector = ConcurrencySaturationDetector(ConcurrencyLimits(CFG), staleness=1.0)
    assert not detector.saturated([snap("a", pending=8), snap("b", pending=7)])
    assert detector.saturated([snap("a", pending=8), snap("b", pending=8)])
    # Requests let through but not leased yet take the room that is left.
    assert detector.saturated([snap("a", pending=8), snap("b", pending=6)], pending=2)
    assert detector.saturated([])


def test_scraped_metrics_never_hold_an_idle_endpoint() -> None:
    """KV use and the engine queue read full, but nothing of ours is there: room for one."""
    detector = ConcurrencySaturationDetector(ConcurrencyLimits(CFG), staleness=1.0)
    idle_but_full = snap("a", pending=0, in_flight=0, waiting=8, kv_usage=0.99)
    assert detector.room(idle_but_full) == 1
    assert not detector.saturated([idle_but_full])
    stale = snap("a", pending=0, in_flight=0, waiting=8, kv_usage=0.99, age=math.inf)
    assert detector.room(stale) == CFG.initial_limit


def test_other_clients_queue_lowers_the_room_softly() -> None:
    detector = ConcurrencySaturationDetector(ConcurrencyLimits(CFG), staleness=1.0)
    assert detector.room(snap("a", pending=2, waiting=5)) == 3  # 8 - (5 - 2 ours) - 2
    assert detector.room(snap("a", pending=2, waiting=5, age=2.0)) == 6  # stale: not counted


def test_config_infers_the_utilization_detector_from_its_thresholds() -> None:
    assert SaturationDetectorConfig().type == "concurrency"
    cfg = SaturationDetectorConfig.model_validate({"queueDepthThreshold": 3})
    assert cfg.type == "utilization"
    with pytest.raises(ValueError, match="queueDepthThreshold only apply to type: utilization"):
        SaturationDetectorConfig.model_validate({"type": "concurrency", "queueDepthThreshold": 3})
    with pytest.raises(ValueError, match="minLimit <= initialLimit <= maxLimit"):
        ConcurrencyLimitConfig.model_validate({"initialLimit": 64, "maxLimit": 32})


async def test_a_first_byte_dispatches_queued_work_at_once() -> None:
    """No tick, no release: the first byte frees a place and the queued request goes."""
    pending = {"a": 0}
    cfg = FlowControlConfig.model_validate(
        {"saturationDetector": {"concurrencyLimit": {"initialLimit": 1, "minLimit": 1}},
         "dispatchIntervalSeconds": 5})
    flow = FlowController(cfg, lambda model: [snap("a", pending=pending["a"])])
    first = await asyncio.wait_for(flow.admit(FlowRequest("m")), 5)
    pending["a"] = 1  # leased, waiting for its first byte: the limit of one is reached
    task = asyncio.ensure_future(flow.admit(FlowRequest("m")))
    await asyncio.sleep(0)
    assert not task.done() and flow.queued == 1
    pending["a"] = 0
    flow.observe("a", 1.0, 0)
    second = await asyncio.wait_for(task, 5)
    assert flow.queued == 0
    first.release()
    second.release()


def test_one_first_byte_far_faster_than_predicted_does_not_cut_the_limit() -> None:
    """A prompt cached beyond what the index knows answers 50x faster than the idle
    prediction: as the baseline, it would make every normal first byte after it read 50x
    slow, and cut the limit to its floor."""
    limits = ConcurrencyLimits(ConcurrencyLimitConfig())
    for _ in range(5):
        limits.observe("a", 1.0, 0)
    limits.observe("a", 0.02, 0)
    for _ in range(60):  # as fast as before, with the gateway's queue there
        limits.observe("a", 1.0, limits.limit("a") - 1)
    assert limits.limit("a") > ConcurrencyLimitConfig().initial_limit


def test_first_bytes_over_the_tolerance_still_cut_after_a_fast_one() -> None:
    limits = ConcurrencyLimits(ConcurrencyLimitConfig())
    limits.observe("a", 0.02, 0)
    for _ in range(10):
        limits.observe("a", 3.0, limits.limit("a") - 1)  # 3x the idle prediction: queueing
    assert limits.limit("a") < ConcurrencyLimitConfig().initial_limit
