"""Flow control config, header resolution and the session boost."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from starlette.datastructures import Headers

# Submodule imports: they work whether or not the editable install predates __init__.py.
from flow_control.config import FlowControlConfig, SessionBoostConfig
from flow_control.request import DEFAULT_FLOW
from flow_control.resolve import ObjectiveResolver, SessionBoost, SessionMemory, fairness_id
from router.config.model import format_validation_error


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def errors(data: object) -> str:
    with pytest.raises(ValidationError) as info:
        FlowControlConfig.model_validate(data)
    return format_validation_error(info.value, "flowControl")


def test_empty_section_has_working_defaults() -> None:
    cfg = FlowControlConfig.model_validate({})
    assert cfg.enabled
    assert cfg.priority_bands == []
    assert cfg.default_band.fairness_policy == "round-robin"
    assert cfg.default_request_ttl == 60.0
    det = cfg.saturation_detector
    assert (det.queue_depth_threshold, det.kv_cache_util_threshold) == (5, 0.8)
    assert det.metrics_staleness_threshold is None  # derived from the scrape settings
    assert det.in_flight_threshold >= 1
    assert not cfg.session_boost.enabled


def test_camel_case_keys_parse() -> None:
    cfg = FlowControlConfig.model_validate(
        {
            "enabled": False,
            "priorityBands": [
                {"priority": 10, "maxRequests": 5, "maxBytes": 100, "fairnessPolicy": "fcfs"}
            ],
            "maxRequests": 7,
            "maxBytes": 1000,
            "defaultRequestTTL": 3,
            "objectives": [{"name": "batch", "priority": -1, "ttlSeconds": 2}],
            "sessionBoost": {"enabled": True, "windowSeconds": 5, "priorityBoost": 2},
            "saturationDetector": {
                "queueDepthThreshold": 3,
                "kvCacheUtilThreshold": 0.9,
                "inFlightThreshold": 10,
                "metricsStalenessThreshold": 0.5,
            },
        }
    )
    assert not cfg.enabled
    assert cfg.priority_bands[0].fairness_policy == "fcfs"
    assert cfg.default_request_ttl == 3
    assert cfg.objectives[0].ttl_seconds == 2
    assert cfg.session_boost.priority_boost == 2
    assert cfg.saturation_detector.in_flight_threshold == 10


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"defaultRequestTtl": 5}, "flowControl.defaultRequestTtl: unknown key"),
        ({"defaultRequestTTL": 0}, "flowControl.defaultRequestTTL:"),
        ({"priorityBands": [{"priority": 1, "maxRequests": 0}]},
         "flowControl.priorityBands[0].maxRequests:"),
        ({"priorityBands": [{"priority": 1, "fairnessPolicy": "lifo"}]},
         "flowControl.priorityBands[0].fairnessPolicy:"),
        ({"priorityBands": [{"maxRequests": 3}]}, "flowControl.priorityBands[0].priority:"),
        ({"priorityBands": [{"priority": 1}, {"priority": 1}]}, "duplicate band priorities"),
        ({"objectives": [{"name": "a"}, {"name": "a"}]}, "duplicate objective names: a"),
        ({"saturationDetector": {"kvCacheUtilThreshold": 1.5}},
         "flowControl.saturationDetector.kvCacheUtilThreshold:"),
        ({"sessionBoost": {"bogus": 1}}, "flowControl.sessionBoost.bogus: unknown key"),
        # Values keep their YAML types: a quoted number or bool is a mistake, not converted.
        ({"enabled": "yes"}, "flowControl.enabled: Input should be a valid boolean"),
        ({"enabled": 1}, "flowControl.enabled: Input should be a valid boolean"),
        ({"maxRequests": "7"}, "flowControl.maxRequests: Input should be a valid integer"),
        (
            {"priorityBands": [{"priority": 1, "programAware": {"serviceWeight": "0.5"}}]},
            "flowControl.priorityBands[0].programAware.serviceWeight: Input should be a valid "
            "number",
        ),
    ],
)
def test_validation_errors_name_the_key(data: object, expected: str) -> None:
    assert expected in errors(data)


def test_fairness_id_headers_and_alias() -> None:
    assert fairness_id({}) == DEFAULT_FLOW
    assert fairness_id({"x-gateway-inference-fairness-id": "t1"}) == "t1"
    assert fairness_id({"x-llm-d-inference-fairness-id": "t2"}) == "t2"
    both = {"x-gateway-inference-fairness-id": "a", "x-llm-d-inference-fairness-id": "b"}
    assert fairness_id(both) == "a"
    assert fairness_id({"x-gateway-inference-fairness-id": "  "}) == DEFAULT_FLOW
    assert fairness_id(Headers({"X-Gateway-Inference-Fairness-Id": "T"})) == "T"
    assert len(fairness_id({"x-gateway-inference-fairness-id": "x" * 10_000})) == 256


def test_objective_resolution() -> None:
    cfg = FlowControlConfig.model_validate(
        {
            "defaultRequestTTL": 30,
            "objectives": [
                {"name": "interactive", "priority": 10, "ttlSeconds": 5},
                {"name": "batch", "priority": -1},
            ],
        }
    )
    resolver = ObjectiveResolver(cfg)
    hit = resolver.resolve({"x-gateway-inference-objective": "interactive"})
    assert (hit.name, hit.priority, hit.ttl_seconds) == ("interactive", 10, 5)
    alias = resolver.resolve({"x-llm-d-inference-objective": "batch"})
    assert (alias.name, alias.priority, alias.ttl_seconds) == ("batch", -1, 30)
    for headers in ({}, {"x-gateway-inference-objective": "unknown"}):
        miss = resolver.resolve(headers)
        assert (miss.name, miss.priority, miss.ttl_seconds) == (None, 0, 30)
    assert resolver.ttl("interactive") == 5
    assert resolver.ttl(None) == resolver.ttl("nope") == 30


def test_session_memory_expires_and_is_bounded() -> None:
    clock = Clock()
    memory = SessionMemory(window_seconds=10, max_sessions=2, clock=clock)
    memory.touch("a")
    memory.touch("b")
    memory.touch("c")  # evicts the least recently seen
    assert not memory.is_live("a")
    assert memory.is_live("b") and memory.is_live("c")
    assert len(memory) == 2
    clock.now += 11
    assert not memory.is_live("b")
    memory.touch("d")  # expired entries go on the next touch too
    assert len(memory) == 1


def test_session_boost() -> None:
    clock = Clock()
    boost = SessionBoost(
        SessionBoostConfig(enabled=True, window_seconds=10, priority_boost=2), clock
    )
    assert boost.apply(0, "s") == 0  # never served
    boost.served("s")
    assert boost.apply(0, "s") == 2
    assert boost.apply(5, "s") == 7
    assert boost.apply(-5, "s") == -3
    assert boost.apply(-1, "s") == -1  # a sheddable request stays sheddable
    assert boost.apply(0, None) == 0
    clock.now += 10.5
    assert boost.apply(0, "s") == 0  # the window has passed
    off = SessionBoost(SessionBoostConfig(enabled=False), clock)
    off.served("s")
    assert off.apply(0, "s") == 0
    assert len(off.memory) == 0


def test_a_queue_depth_threshold_of_zero_is_refused() -> None:
    """Every endpoint has at least 0 waiting requests: 0 would hold every request in the
    gateway (llm-d refuses it too)."""
    assert "flowControl.saturationDetector.queueDepthThreshold:" in errors(
        {"saturationDetector": {"queueDepthThreshold": 0}}
    )
