"""llm-d EndpointPickerConfigs accepted as they are (router/config/llmd.py, llmd_plugins.py).

Every config here is written for the test, one concept at a time; none is a copy of llm-d's
sample files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.sim.cli import Replica
from router.app import build_gateway
from router.cli import _serve_config, build_parser
from router.config.llmd_plugins import RULES
from router.config.llmd_refused import REFUSED
from router.config.model import GatewayConfig, load_config, parse_config
from router.core.errors import ConfigError
from router.serve.server import running_gateway
from tests.gateways import MODEL

LLMD = "llm-d.ai/v1alpha1"


def llmd(plugins: list[dict[str, Any]], profile: list[dict[str, Any]] | None = None,
         **extra: Any) -> dict[str, Any]:
    """A one-profile llm-d config over ``plugins`` (the profile references every scheduling
    plugin named in ``profile``, default: none)."""
    return {
        "apiVersion": LLMD, "kind": "EndpointPickerConfig", "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": profile or []}], **extra,
    }


BASIC = llmd(
    [{"type": "single-profile-handler"}, {"type": "decode-filter"},
     {"type": "prefix-cache-scorer"}, {"type": "queue-scorer", "name": "q"},
     {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 1}}],
    [{"pluginRef": "decode-filter"}, {"pluginRef": "prefix-cache-scorer", "weight": 3},
     {"pluginRef": "q", "weight": 1}, {"pluginRef": "max-score-picker"}],
)


def test_single_profile_becomes_the_same_weighted_profile() -> None:
    for api in (LLMD, "inference.networking.x-k8s.io/v1alpha1"):
        config = parse_config({**BASIC, "apiVersion": api})
        assert config.plugins is not None and config.scheduling_profiles is not None
        assert [(p.type, p.ref) for p in config.plugins] == [
            ("decode-filter", "decode-filter"), ("prefix-cache-scorer", "prefix-cache-scorer"),
            ("queue-scorer", "q"), ("max-score-picker", "max-score-picker"),
        ]
        refs = [(r.plugin_ref, r.weight) for r in config.scheduling_profiles[0].plugins]
        assert refs == [("decode-filter", None), ("prefix-cache-scorer", 3.0), ("q", 1.0),
                        ("max-score-picker", None)]
        assert config.compatibility is not None and config.compatibility.source == api
        assert not config.flow_control.enabled, "no flowControl feature gate"
    profile = build_gateway(parse_config(BASIC)).scheduler.profile
    assert [s.name for s in profile.scorers] == ["prefix-cache-scorer", "q"]


def test_without_scheduling_profiles_one_default_profile_holds_every_scheduling_plugin() -> None:
    """As llm-d's loader does: no ``schedulingProfiles`` means one profile, ``default``, of
    every filter, scorer and picker the plugins list, in their order, each at weight 1."""
    config = {key: value for key, value in BASIC.items() if key != "schedulingProfiles"}
    native = parse_config(config)
    assert native.scheduling_profiles is not None
    (profile,) = native.scheduling_profiles
    assert profile.name == "default"
    assert [r.plugin_ref for r in profile.plugins] == [
        "decode-filter", "prefix-cache-scorer", "q", "max-score-picker",
    ]
    built = build_gateway(native).scheduler.profile
    assert [(s.name, s.weight) for s in built.scorers] == [("prefix-cache-scorer", 1.0), ("q", 1.0)]


def test_the_older_prefix_scorer_with_its_sizing_parameters_sizes_the_prefix_index() -> None:
    """Before llm-d split out the producer, the scorer carried the index's sizing (as in the
    Gateway API Inference Extension's samples): read as the producer's parameters are."""
    config = llmd(
        [{"type": "prefix-cache-scorer", "parameters": {
            "hashBlockSize": 64, "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 31250,
        }}, {"type": "max-score-picker"}],
        [{"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "max-score-picker"}],
    )
    native = parse_config(config)
    index = native.prefix_index
    assert (index.block_bytes, index.max_blocks_per_request) == (64, 256)
    assert index.capacity_blocks is None, "sized by each endpoint's KV capacity (autoTune)"
    assert native.compatibility is not None
    assert any("lruCapacityPerServer" in note for note in native.compatibility.ignored)
    fixed = parse_config(llmd(
        [{"type": "prefix-cache-scorer", "parameters": {
            "hashBlockSize": 64, "lruCapacityPerServer": 1000, "autoTune": False,
        }}],
        [{"pluginRef": "prefix-cache-scorer"}],
    ))
    assert fixed.prefix_index.capacity_blocks == 1000
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.hashBlockSizes"):
        parse_config(llmd([{"type": "prefix-cache-scorer", "parameters": {"hashBlockSizes": 64}}]))


def test_prefixgate_sections_sit_alongside_and_win() -> None:
    config = parse_config({
        **BASIC, "pool": {"endpoints": [{"url": "http://127.0.0.1:8001"}]},
        "server": {"port": 9001}, "prefixIndex": {"blockBytes": 512},
        "plugins": [*BASIC["plugins"], {"type": "approx-prefix-cache-producer",
                                         "parameters": {"blockSizeTokens": 32}}],
    })
    assert config.server.port == 9001 and len(config.pool.endpoints) == 1
    assert config.prefix_index.block_bytes == 512


def test_approx_producer_sizes_the_prefix_index() -> None:
    fixed = {"type": "approx-prefix-cache-producer", "parameters": {
        "autoTune": False, "blockSizeTokens": 32, "maxPrefixTokensToMatch": 8192,
        "lruCapacityPerServer": 1000}}
    index = parse_config(llmd([fixed])).prefix_index
    assert (index.block_bytes, index.max_blocks_per_request, index.capacity_blocks) == (
        128, 256, 1000)
    auto = {"type": "approx-prefix-cache-producer", "parameters": {"lruCapacityPerServer": 9}}
    config = parse_config(llmd([auto]))
    assert config.prefix_index.capacity_blocks is None, "sized by each endpoint's KV"
    assert config.compatibility is not None
    assert any("lruCapacityPerServer" in n for n in config.compatibility.ignored)
    # llm-d's deprecated blockSize counts characters, and blockSizeTokens wins beside it.
    legacy = {"type": "approx-prefix-cache-producer", "parameters": {
        "autoTune": False, "blockSize": 64, "lruCapacityPerServer": 1000}}
    index = parse_config(llmd([legacy])).prefix_index
    assert (index.block_bytes, index.capacity_blocks) == (64, 1000)
    both = {"type": "approx-prefix-cache-producer", "parameters": {
        "blockSizeTokens": 16, "blockSize": 64}}
    assert parse_config(llmd([both])).prefix_index.block_bytes == 64  # 16 tokens, 4 bytes each


def test_precise_producer_token_producer_and_the_scorer_that_reads_them() -> None:
    config = parse_config(llmd(
        [{"type": "prefix-cache-scorer", "name": "hits",
          "parameters": {"prefixMatchInfoProducerName": "precise"}},
         {"type": "token-producer", "parameters": {
             "modelName": "m", "vllm": {"url": "http://x:8000", "timeout": "2s"}}},
         {"type": "precise-prefix-cache-producer", "name": "precise", "parameters": {
             "tokenProcessorConfig": {"blockSizeTokens": 64, "hashSeed": "7"},
             "kvEventsConfig": {"zmqEndpoint": "tcp://*:5557", "topicFilter": "kv@",
                                "podDiscoveryConfig": {"socketPort": 5600}},
             "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}}}}],
        [{"pluginRef": "hits", "weight": 2}],
    ))
    assert config.plugins is not None
    assert [p.type for p in config.plugins] == ["precise-prefix-cache-scorer"]
    precise = config.precise_prefix
    assert (precise.enabled, precise.block_size) == (True, 64)
    assert (precise.kv_events.port, precise.kv_events.topic) == (5600, "kv@")
    assert (precise.tokenizer.type, precise.tokenizer.timeout_ms) == ("remote", 2000.0)
    assert config.compatibility is not None
    ignored = "\n".join(config.compatibility.ignored)
    for key in ("vllm.url", "modelName", "hashSeed", "zmqEndpoint", "kvBlockIndexConfig"):
        assert key in ignored


def pd_config(decider: dict[str, Any], profiles: dict[str, str] | None = None) -> dict[str, Any]:
    names = profiles or {"prefill": "prefill", "decode": "decode"}
    handler = {"type": "disagg-profile-handler", "parameters": {
        "deciders": {"prefill": "pd"}, **({"profiles": profiles} if profiles else {})}}
    return {
        "apiVersion": LLMD,
        "plugins": [{**decider, "name": "pd"}, handler, {"type": "prefill-filter"},
                    {"type": "decode-filter"}, {"type": "queue-scorer"}],
        "schedulingProfiles": [
            {"name": names["prefill"], "plugins": [{"pluginRef": "prefill-filter"},
                                                   {"pluginRef": "queue-scorer"}]},
            {"name": names["decode"], "plugins": [{"pluginRef": "decode-filter"}]},
        ],
    }


def test_disagg_handler_with_prefix_decider_turns_disaggregation_on() -> None:
    decider = {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 512}}
    config = parse_config(pd_config(decider, {"prefill": "p", "decode": "d"}))
    pd = config.disaggregation
    assert (pd.enabled, pd.non_cached_tokens) == (True, 512)
    assert config.scheduling_profiles is not None
    assert [p.name for p in config.scheduling_profiles] == ["decode", "prefill"]
    assert build_gateway(config).proxy.disagg is not None
    off = parse_config(pd_config({"type": "prefix-based-pd-decider"}))
    assert not off.disaggregation.enabled, "nonCachedTokens 0 turns it off, as in llm-d"
    always = parse_config(pd_config({"type": "always-disagg-pd-decider"})).disaggregation
    assert (always.enabled, always.non_cached_tokens) == (True, 0)
    broken = pd_config(decider)
    broken["plugins"][1]["parameters"]["deciders"] = {"prefill": "nope"}
    with pytest.raises(ConfigError, match=r"deciders\.prefill: no decider plugin named 'nope'"):
        parse_config(broken)


def test_load_aware_and_no_hit_lru_scorers() -> None:
    config = parse_config(llmd(
        [{"type": "load-aware-scorer", "parameters": {"threshold": 64}},
         {"type": "no-hit-lru-scorer", "parameters": {"lruSize": 8,
                                                      "prefixPluginName": "approx"}}],
        [{"pluginRef": "load-aware-scorer"}, {"pluginRef": "no-hit-lru-scorer"}],
    ))
    assert config.plugins is not None
    assert [(p.type, p.parameters) for p in config.plugins] == [
        ("load-aware-scorer", {"threshold": 64}), ("no-hit-lru-scorer", {"lruSize": 8})]
    gateway = build_gateway(config)
    lru = gateway.scheduler.profile.scorers[1].scorer
    assert lru in gateway.scheduler._observers, "learns from each pick"


FAIR = {"type": "program-aware-fairness", "name": "las",
        "parameters": {"lasHalfLifeSeconds": 30, "evictionTtlSeconds": 60}}


def test_program_aware_fairness_feature_gate_and_bands() -> None:
    config = parse_config(llmd(
        [FAIR, {"type": "round-robin-fairness-policy", "name": "rr"},
         {"type": "fcfs-ordering-policy"}],
        featureGates=["flowControl"],
        flowControl={
            "maxBytes": "1Gi", "maxRequests": 2000, "defaultRequestTTL": "1m30s",
            "defaultPriorityBand": {"fairnessPolicyRef": "las",
                                    "orderingPolicyRef": "fcfs-ordering-policy"},
            "priorityBands": [{"priority": 10, "maxRequests": "500", "fairnessPolicyRef": "rr"}],
        },
    ))
    flow = config.flow_control
    assert flow.enabled and (flow.max_bytes, flow.max_requests) == (2**30, 2000)
    assert flow.default_request_ttl == 90.0
    band = flow.default_band
    assert band.fairness_policy == "program-aware" and band.program_aware.half_life_seconds == 30
    assert [(b.priority, b.max_requests, b.fairness_policy) for b in flow.priority_bands] == [
        (10, 500, "round-robin")]
    assert config.compatibility is not None
    assert any("evictionTtlSeconds" in n for n in config.compatibility.ignored)


def test_saturation_detectors_map_onto_the_detector_thresholds() -> None:
    utilization = {"type": "utilization-detector", "name": "u", "parameters": {
        "queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.9,
        "metricsStalenessThreshold": "500ms", "headroom": 0.2}}
    config = parse_config(llmd([utilization], featureGates=["flowControl"],
                               flowControl={"saturationDetector": {"pluginRef": "u"}}))
    detector = config.flow_control.saturation_detector
    assert (detector.queue_depth_threshold, detector.kv_cache_util_threshold,
            detector.metrics_staleness_threshold) == (8, 0.9, 0.5)
    concurrency = {"type": "concurrency-detector", "name": "c",
                   "parameters": {"maxConcurrency": 64}}
    config = parse_config(llmd([concurrency], saturationDetector={"pluginRef": "c"}))
    assert config.flow_control.saturation_detector.in_flight_threshold == 64


def test_data_layer_parsers_agent_identity_and_metrics_source() -> None:
    config = parse_config(llmd(
        [{"type": "metrics-data-source", "parameters": {"interval": "250ms"}},
         {"type": "core-metrics-extractor"}, {"type": "endpoint-notification-source"},
         {"type": "openai-parser"},
         {"type": "agent-identity", "parameters": {"additionalSessionHeaders": ["x-run"]}}],
        dataLayer={"sources": [{"pluginRef": "metrics-data-source",
                                "extractors": [{"pluginRef": "core-metrics-extractor"}]},
                               {"pluginRef": "endpoint-notification-source"}]},
        requestHandler={"parsers": [{"pluginRef": "openai-parser"}]},
    ))
    assert config.pool.metrics_scrape.interval_seconds == 0.25
    assert config.session_affinity.headers == ["x-run"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (llmd([{"type": "soft-reflective-ceiling-policy"}]),
         r"plugins\[0\]\.type: llm-d plugin 'soft-reflective-ceiling-policy' has no "
         r"counterpart in prefixgate; use flowControl priority bands"),
        (llmd([{"type": "latency-slo-admitter"}]), "latency-slo-admitter"),
        (llmd([{"type": "made-up-scorer"}]), r"unknown plugin type 'made-up-scorer'"),
        (llmd([{"type": "load-aware-scorer", "parameters": {"treshold": 3}}]),
         r"plugins\[0\]\.parameters\.treshold: unknown parameter of load-aware-scorer"),
        (llmd([], featureGates=["warpDrive"]), r"featureGates\[0\]: unknown feature gate"),
        (llmd([{"type": "queue-scorer"}], [{"pluginRef": "nope"}]),
         r"schedulingProfiles\[0\]\.plugins\[0\]\.pluginRef: no plugin named 'nope'"),
        (llmd([FAIR], featureGates=["flowControl"],
              flowControl={"defaultPriorityBand": {"fairnessPolicyRef": "other"}}),
         r"flowControl\.defaultPriorityBand\.fairnessPolicyRef: no fairness policy"),
        (llmd([], dataLayer={"peerDiscovery": {"pluginRef": "x"}}),
         r"dataLayer\.peerDiscovery: .*Redis"),
        (llmd([], flowControl={"enableEviction": True}), r"flowControl\.enableEviction"),
        (llmd([{"type": "single-profile-handler"}, {"type": "queue-scorer"}],
              [{"pluginRef": "single-profile-handler"}]),
         r"'single-profile-handler' \(single-profile-handler\) is not a filter"),
    ],
)
def test_what_has_no_counterpart_fails_naming_it(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_ignored_parameters_are_logged_once_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(llmd(
        [{"type": "data-parallel-profile-handler", "parameters": {"primaryPort": 8000}},
         {"type": "burst-prefix-cache-producer", "parameters": {"windowDurationMs": 50}}],
        featureGates=["haPopulateNonLeaderDatastore"],
    )))
    config = load_config(path)
    # The CLI dumps and re-parses a loaded config: the translation must survive that.
    again = parse_config(config.model_dump(by_alias=True, exclude_unset=True))
    assert isinstance(again, GatewayConfig) and again.compatibility == config.compatibility
    with caplog.at_level(logging.WARNING, logger="prefixgate.app"):
        build_gateway(again)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.app"]
    assert len(lines) == 3 and len(set(lines)) == 3
    assert any("plugins[0].parameters.primaryPort (data-parallel-profile-handler)" in line
               for line in lines)
    assert any("windowDurationMs" in line for line in lines)
    assert any("haPopulateNonLeaderDatastore" in line for line in lines)


def test_the_compatibility_page_lists_every_llm_d_type() -> None:
    page = (Path(__file__).parents[3] / "docs" / "llm-d-compatibility.md").read_text()
    missing = [t for t in [*RULES, *REFUSED] if f"`{t}`" not in page]
    assert not missing, missing


@pytest.mark.slow
async def test_an_llm_d_config_serves_with_backends_and_new_sessions_rotate(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    """Through the CLI's path (--config plus --backend): no-hit-lru-scorer alone sends each new
    session to the replica that least recently got one."""
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(llmd(
        [{"type": "single-profile-handler"}, {"type": "no-hit-lru-scorer"},
         {"type": "max-score-picker"}],
        [{"pluginRef": "no-hit-lru-scorer"}, {"pluginRef": "max-score-picker"}],
    )))
    argv = ["serve", "--config", str(path), "--port", "0"]
    for r in replicas:
        argv += ["--backend", r.url]
    config = _serve_config(build_parser().parse_args(argv))
    homes = []
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        for i in range(len(replicas) + 1):
            body = {"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"task {i}: " + f"t{i} " * 80}]}
            r = await http.post("/v1/chat/completions", json=body,
                                headers={"x-session-id": f"s{i}"})
            assert r.status_code == 200, r.text
            homes.append(r.headers["x-gateway-destination-endpoint"])
    assert len(set(homes[:-1])) == len(replicas)
    assert homes[-1] == homes[0], "the least recently used replica gets the next new session"


@pytest.mark.parametrize("parameters", [{}, {"kvCacheUtilThreshold": 0.8}])
def test_a_utilization_detector_is_one_with_or_without_parameters(
    parameters: dict[str, Any],
) -> None:
    """llm-d's utilization-detector with its defaults is still the utilization detector, not
    prefixgate's learned concurrency limits."""
    detector = {"type": "utilization-detector", "name": "u", "parameters": parameters}
    config = parse_config(llmd([detector], featureGates=["flowControl"],
                               flowControl={"saturationDetector": {"pluginRef": "u"}}))
    saturation = config.flow_control.saturation_detector
    assert saturation.type == "utilization"
    assert (saturation.queue_depth_threshold, saturation.kv_cache_util_threshold) == (5, 0.8)


@pytest.mark.parametrize("parameters", [{}, {"maxConcurrency": 100}])
def test_a_concurrency_detector_means_the_same_with_its_default_spelled_out(
    parameters: dict[str, Any],
) -> None:
    """llm-d's concurrency-detector defaults maxConcurrency to 100: leaving it out must not
    change which detector runs."""
    detector = {"type": "concurrency-detector", "name": "c", "parameters": parameters}
    config = parse_config(llmd([detector], featureGates=["flowControl"],
                               flowControl={"saturationDetector": {"pluginRef": "c"}}))
    saturation = config.flow_control.saturation_detector
    assert (saturation.type, saturation.in_flight_threshold) == ("utilization", 100)


def test_a_detector_named_utilization_detector_is_used_without_a_plugin_ref() -> None:
    """llm-d's saturationDetector.pluginRef defaults to utilization-detector: a plugin of
    that name is the detector even when nothing references it."""
    detector = {"type": "utilization-detector", "parameters": {"queueDepthThreshold": 8}}
    config = parse_config(llmd([detector], featureGates=["flowControl"]))
    saturation = config.flow_control.saturation_detector
    assert (saturation.type, saturation.queue_depth_threshold) == ("utilization", 8)


def test_program_aware_parameters_are_checked_under_their_own_names() -> None:
    """A negative LAS weight fails naming the llm-d parameter, as llm-d does, whether or not
    a band references the policy."""
    policy = {"type": "program-aware-fairness", "parameters": {"lasWeightService": -1}}
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.lasWeightService"):
        parse_config(llmd([policy]))
