"""llm-d's flow-control and request-side plugins, as rules of router/config/llmd_plugins.py.

Fairness policies become a band's ``fairnessPolicy`` (``program-aware-fairness`` is the
``program-aware`` policy with llm-d's parameters), saturation detectors become
``flowControl.saturationDetector`` (utilization-detector: the queue-depth, KV and staleness
thresholds; concurrency-detector: the in-flight threshold), ``agent-identity`` adds session
headers, ``metrics-data-source`` sets the scrape interval.
"""

from __future__ import annotations

from typing import Any

from router.config.llmd_params import Params, Rule, State, check, duration_seconds
from router.core.errors import ConfigError


def _program_aware(state: State, name: str, p: Params) -> None:
    strategy = p.get("strategy", str, "las")
    if strategy != "las":
        raise ConfigError(f"{p.at('strategy')}: only 'las' (least attained service) exists here")
    params: dict[str, float] = {}
    for key, native, default in (("lasWeightService", "serviceWeight", 0.8),
                                 ("lasWeightHeadWait", "headWaitWeight", 0.2),
                                 ("lasHalfLifeSeconds", "halfLifeSeconds", 60.0)):
        value = params[native] = p.get(key, float, default)
        if not value >= 0:  # checked here, as llm-d does, even if no band names the policy
            raise ConfigError(f"{p.at(key)}: must be >= 0, got {value!r}")
    for key, positive in (("evictionTtlSeconds", False), ("evictionSweepSeconds", True)):
        if p.has(key):  # checked as llm-d does, then ignored
            value = p.get(key, float, 0.0)
            check(value > 0 if positive else value >= 0, p.at(key),
                  "must be above 0" if positive else "must be >= 0", value)
            state.notes.ignore(f"{p.at(key)} ({p.type})", "idle programs are forgotten by "
                               "count (programAware.maxPrograms), not by age")
    p.done()
    state.fairness[name] = {"fairnessPolicy": "program-aware", "programAware": params}


def _fairness(policy: str) -> Rule:
    def rule(state: State, name: str, p: Params) -> None:
        p.done()
        state.fairness[name] = {"fairnessPolicy": policy}

    return rule


def _fcfs_ordering(state: State, name: str, p: Params) -> None:
    p.done()
    state.orderings.add(name)


def _headroom(state: State, p: Params) -> None:
    if p.has("headroom"):
        headroom = p.get("headroom", float, 0.0)
        check(headroom >= 0, p.at("headroom"), "must be >= 0", headroom)
        state.notes.ignore(f"{p.at('headroom')} ({p.type})",
                           "routing does not filter endpoints on the detector's limits")


def _utilization_detector(state: State, name: str, p: Params) -> None:
    # The type too: without a threshold set, prefixgate's default is the concurrency detector.
    detector: dict[str, Any] = {"type": "utilization"}
    if p.has("queueDepthThreshold"):
        depth = detector["queueDepthThreshold"] = p.get("queueDepthThreshold", int, 5)
        check(depth > 0, p.at("queueDepthThreshold"), "must be > 0", depth)
    if p.has("kvCacheUtilThreshold"):
        kv = detector["kvCacheUtilThreshold"] = p.get("kvCacheUtilThreshold", float, 0.8)
        check(0 < kv <= 1, p.at("kvCacheUtilThreshold"), "must be in (0, 1]", kv)
    if p.has("metricsStalenessThreshold"):
        raw = p.get("metricsStalenessThreshold", str, "")
        stale = duration_seconds(raw, p.at("metricsStalenessThreshold"))
        check(stale > 0, p.at("metricsStalenessThreshold"), "must be above 0", raw)
        detector["metricsStalenessThreshold"] = stale
    _headroom(state, p)
    p.done()
    state.detectors[name] = detector


def _concurrency_detector(state: State, name: str, p: Params) -> None:
    detector: dict[str, Any] = {}
    mode = p.get("concurrencyMode", str, "requests")
    if mode == "tokens":
        raise ConfigError(f"{p.at('concurrencyMode')}: 'tokens' is not supported here (the "
                          "gateway counts requests in flight, not tokens); use requests")
    if mode != "requests":
        raise ConfigError(f"{p.at('concurrencyMode')}: unknown mode {mode!r} (requests or "
                          "tokens)")
    # llm-d's default, so that leaving it out means what spelling it out does.
    limit = detector["inFlightThreshold"] = p.get("maxConcurrency", int, 100)
    check(limit > 0, p.at("maxConcurrency"), "must be > 0", limit)
    _headroom(state, p)
    if p.has("maxTokenConcurrency"):
        tokens = p.get("maxTokenConcurrency", int, 1)
        check(tokens > 0, p.at("maxTokenConcurrency"), "must be > 0", tokens)
        state.notes.ignore(f"{p.at('maxTokenConcurrency')} ({p.type})",
                           "the gateway counts requests in flight, not tokens")
    p.ignore("the gateway counts requests in flight itself", inFlightLoadProducerName=str)
    p.done()
    state.detectors[name] = detector


def _agent_identity(state: State, name: str, p: Params) -> None:
    headers = p.get("additionalSessionHeaders", list, [])
    if not all(isinstance(h, str) for h in headers):
        raise ConfigError(f"{p.at('additionalSessionHeaders')}: a list of header names")
    p.done()
    state.section("sessionAffinity")["headers"] = headers


def _metrics_source(state: State, name: str, p: Params) -> None:
    if p.has("interval"):
        interval = p.get("interval", str, "")
        scrape = state.section("pool", "metricsScrape")
        scrape["intervalSeconds"] = duration_seconds(interval, p.at("interval"))
    path = p.get("path", str, "/metrics")
    if path != "/metrics":
        raise ConfigError(f"{p.at('path')}: metrics are read from /metrics only")
    p.ignore("metrics are read over the endpoint's own URL (pool.endpoints[].url)",
             scheme=str, port=int, insecureSkipVerify=bool, caCertPath=str,
             clientCertPath=str, clientKeyPath=str)
    p.done()


FLOW_RULES: dict[str, Rule] = {
    "program-aware-fairness": _program_aware,
    "round-robin-fairness-policy": _fairness("round-robin"),
    "global-strict-fairness-policy": _fairness("fcfs"),
    "fcfs-ordering-policy": _fcfs_ordering,
    "utilization-detector": _utilization_detector,
    "concurrency-detector": _concurrency_detector,
    "agent-identity": _agent_identity,
    "metrics-data-source": _metrics_source,
}
