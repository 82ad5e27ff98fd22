"""Values llm-d refuses are refused here too, naming the key as the llm-d config spells it
(router/config/llmd.py, llmd_plugins.py, llmd_flow.py). Every config is written for the test."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.model import parse_config
from router.core.errors import ConfigError

LLMD = "llm-d.ai/v1alpha1"


def one(type_: str, name: str | None = None, **parameters: Any) -> dict[str, Any]:
    """A config of one plugin (with ``parameters``) and an empty profile."""
    plugin: dict[str, Any] = {"type": type_, "parameters": parameters}
    if name:
        plugin["name"] = name
    return {"apiVersion": LLMD, "plugins": [plugin],
            "schedulingProfiles": [{"name": "default", "plugins": []}]}


def test_burst_producer_takes_all_of_llm_d_s_parameters() -> None:
    config = parse_config(one("burst-prefix-cache-producer", windowDurationMs=20,
                              maxPerReplica=2, minColocateBlocks=1, blockSizeTokens=32,
                              maxPrefixTokensToMatch=4096, maxBatchSize=-1,
                              balanceBy="tokens"))
    assert config.compatibility is not None
    ignored = "\n".join(config.compatibility.ignored)
    for key in ("balanceBy", "maxBatchSize", "blockSizeTokens", "maxPrefixTokensToMatch"):
        assert key in ignored


@pytest.mark.parametrize(
    ("parameters", "key"),
    [
        ({"balanceBy": "bytes"}, "balanceBy"),
        ({"windowDurationMs": 0}, "windowDurationMs"),
        ({"windowDurationMs": 60_000}, "windowDurationMs"),
        ({"maxPerReplica": 0}, "maxPerReplica"),
        ({"minColocateBlocks": -1}, "minColocateBlocks"),
        ({"maxBatchSize": 0}, "maxBatchSize"),
        ({"blockSizeTokens": 0}, "blockSizeTokens"),
        ({"maxPrefixTokensToMatch": 8, "blockSizeTokens": 64}, "maxPrefixTokensToMatch"),
    ],
)
def test_burst_producer_values_llm_d_refuses(parameters: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"plugins\[0\]\.parameters\.{key}: must"):
        parse_config(one("burst-prefix-cache-producer", **parameters))


@pytest.mark.parametrize(
    ("type_", "parameters", "key"),
    [
        ("prefix-cache-scorer", {"matchLengthWeight": -0.5}, "matchLengthWeight"),
        ("prefix-cache-scorer", {"matchLengthWeight": 2.0}, "matchLengthWeight"),
        ("prefix-cache-scorer", {"matchLengthWeight": 0.3}, "matchLengthScaleTokens"),
        ("approx-prefix-cache-producer", {"maxPrefixTokensToMatch": -1},
         "maxPrefixTokensToMatch"),
        ("approx-prefix-cache-producer", {"autoTune": False, "blockSizeTokens": 0},
         "blockSizeTokens"),
        ("precise-prefix-cache-producer", {"tokenProcessorConfig": {"blockSizeTokens": -16}},
         r"tokenProcessorConfig\.blockSizeTokens"),
        ("utilization-detector", {"queueDepthThreshold": 0}, "queueDepthThreshold"),
        ("utilization-detector", {"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold"),
        ("utilization-detector", {"metricsStalenessThreshold": "0s"},
         "metricsStalenessThreshold"),
        ("utilization-detector", {"headroom": -0.1}, "headroom"),
        ("concurrency-detector", {"maxConcurrency": 0}, "maxConcurrency"),
        ("concurrency-detector", {"headroom": -1}, "headroom"),
        ("concurrency-detector", {"maxTokenConcurrency": 0}, "maxTokenConcurrency"),
        ("data-parallel-profile-handler", {"primaryPort": 0x10000}, "primaryPort"),
        ("session-affinity-scorer", {"strategy": "cookie"}, "strategy"),
        ("program-aware-fairness", {"evictionTtlSeconds": -1}, "evictionTtlSeconds"),
        ("program-aware-fairness", {"evictionSweepSeconds": 0}, "evictionSweepSeconds"),
    ],
)
def test_values_llm_d_refuses_fail_naming_the_plugin_parameter(
    type_: str, parameters: dict[str, Any], key: str
) -> None:
    """Checked where the plugin is declared, as llm-d does, whether or not anything uses it,
    and named as written (not as the prefixgate setting it becomes)."""
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]\.parameters\.{key}: "):
        parse_config(one(type_, **parameters))


@pytest.mark.parametrize(
    ("type_", "parameters", "key", "expected"),
    [
        ("load-aware-scorer", {"threshold": "2"}, "threshold", "int"),
        ("no-hit-lru-scorer", {"lruSize": True}, "lruSize", "int"),
        ("approx-prefix-cache-producer", {"autoTune": "false"}, "autoTune", "bool"),
        ("approx-prefix-cache-producer", {"autoTune": 0}, "autoTune", "bool"),
        ("utilization-detector", {"kvCacheUtilThreshold": "0.9"}, "kvCacheUtilThreshold", "float"),
        ("program-aware-fairness", {"lasWeightService": "0.5"}, "lasWeightService", "float"),
    ],
)
def test_a_value_of_another_type_fails_naming_the_plugin_parameter(
    type_: str, parameters: dict[str, Any], key: str, expected: str
) -> None:
    """As llm-d's JSON decoding into Go structs: a quoted number or bool is not converted."""
    with pytest.raises(
        ConfigError, match=rf"^plugins\[0\]\.parameters\.{key}: expected {expected}, got"
    ):
        parse_config(one(type_, **parameters))


@pytest.mark.parametrize("strategy", ["encoded_endpoint_header", "session_id"])
def test_session_affinity_strategies_llm_d_knows_load(strategy: str) -> None:
    config = parse_config(one("session-affinity-scorer", strategy=strategy))
    assert config.compatibility is not None
    assert any(".strategy (session-affinity-scorer)" in n for n in config.compatibility.ignored)


def test_concurrency_mode_tokens_is_refused_and_an_unknown_mode_is_called_unknown() -> None:
    with pytest.raises(ConfigError, match=r"concurrencyMode: .*'tokens'.*not supported"):
        parse_config(one("concurrency-detector", concurrencyMode="tokens"))
    with pytest.raises(ConfigError, match=r"concurrencyMode: unknown mode 'bytes'"):
        parse_config(one("concurrency-detector", concurrencyMode="bytes"))


def test_precise_indexer_takes_llm_d_kv_cache_s_backend_key() -> None:
    """llm-d-kv-cache's indexer config spells its backends kvCacheBackendConfigs."""
    indexer = {"kvBlockIndexConfig": {"enableMetrics": False},
               "kvCacheBackendConfigs": [{"name": "gpu", "weight": 1.0}]}
    config = parse_config(one("precise-prefix-cache-producer", indexerConfig=indexer))
    assert config.precise_prefix.enabled
    with pytest.raises(ConfigError, match=r"indexerConfig\.backendConfigs: unknown parameter"):
        parse_config(one("precise-prefix-cache-producer",
                         indexerConfig={"backendConfigs": []}))


def profiles(weight: Any) -> dict[str, Any]:
    """Prefill first, as llm-d's samples list them; the weight on its queue scorer."""
    return {
        "apiVersion": LLMD,
        "plugins": [{"type": "prefill-filter"}, {"type": "decode-filter"},
                    {"type": "queue-scorer"}, {"type": "prefix-based-pd-decider",
                                               "parameters": {"nonCachedTokens": 8}},
                    {"type": "disagg-profile-handler",
                     "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}}}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"},
                                            {"pluginRef": "queue-scorer", "weight": weight}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"},
                                           {"pluginRef": "queue-scorer", "weight": 1}]},
        ],
    }


@pytest.mark.parametrize("weight", [-1, float("inf"), float("nan"), "2", True])
def test_a_bad_weight_fails_naming_the_profile_as_written(weight: Any) -> None:
    """The prefill profile is schedulingProfiles[0] in the file, whatever order the
    translation puts the profiles in."""
    with pytest.raises(ConfigError,
                       match=r"^schedulingProfiles\[0\]\.plugins\[1\]\.weight: "):
        parse_config(profiles(weight))


def test_a_good_weight_and_a_null_weight_load() -> None:
    assert parse_config(profiles(2.5)).disaggregation.enabled
    assert parse_config(profiles(None)).disaggregation.enabled


@pytest.mark.parametrize(
    ("type_", "parameters", "key"),
    [
        ("metrics-data-source", {"insecureSkipVerify": "true"}, "insecureSkipVerify"),
        ("metrics-data-source", {"port": "9090"}, "port"),
        ("max-score-picker", {"maxNumOfEndpoints": "1"}, "maxNumOfEndpoints"),
        ("no-hit-lru-scorer", {"prefixPluginName": 3}, "prefixPluginName"),
        ("active-request-scorer", {"requestTimeout": 120}, "requestTimeout"),
        ("active-request-scorer", {"maxBusyScore": "0.5"}, "maxBusyScore"),
        ("session-affinity-scorer", {"sessionIdConfig": "x-session-id"}, "sessionIdConfig"),
        ("precise-prefix-cache-producer", {"speculativeIndexing": "yes"}, "speculativeIndexing"),
        ("precise-prefix-cache-producer", {"kvEventsConfig": {"discoverPods": "true"}},
         r"kvEventsConfig\.discoverPods"),
        ("precise-prefix-cache-producer",
         {"indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": "true"}}},
         r"indexerConfig\.kvBlockIndexConfig\.enableMetrics"),
        ("token-producer", {"vllm": {"mmTimeout": "soon"}}, r"vllm\.mmTimeout"),
        ("concurrency-detector", {"inFlightLoadProducerName": 1}, "inFlightLoadProducerName"),
    ],
)
def test_an_ignored_parameter_of_the_wrong_type_fails_naming_it(
    type_: str, parameters: dict[str, Any], key: str
) -> None:
    """Ignored here, but llm-d decodes it into its Go type and would refuse it: so does this."""
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]\.parameters\.{key}: "):
        parse_config(one(type_, **parameters))


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"flowControl": {"noEndpointRequestTTL": True}}, r"flowControl\.noEndpointRequestTTL"),
        ({"dataLayer": {"crossReplicaSyncInterval": "often"}},
         r"dataLayer\.crossReplicaSyncInterval"),
    ],
)
def test_an_ignored_section_key_of_the_wrong_type_fails_naming_it(
    data: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        parse_config({**one("queue-scorer"), "featureGates": ["flowControl"], **data})


def test_ignored_parameters_of_the_right_type_load_and_are_logged() -> None:
    config = parse_config(one("metrics-data-source", insecureSkipVerify=True, port=9090,
                              scheme="https", caCertPath="/etc/ca.pem"))
    assert config.compatibility is not None
    assert any(".insecureSkipVerify (metrics-data-source)" in n
               for n in config.compatibility.ignored)


@pytest.mark.parametrize("type_", ["precise-prefix-cache-scorer", "precise-prefix-cache-producer"])
def test_speculative_keys_load_inside_indexer_config_as_at_the_top(type_: str) -> None:
    """llm-d's samples put speculativeIndexing inside indexerConfig; the TTL maps the same
    from either placement."""
    inner = parse_config(one(type_, indexerConfig={"speculativeIndexing": True,
                                                   "speculativeTTL": "500ms"}))
    top = parse_config(one(type_, speculativeIndexing=True, speculativeTTL="500ms"))
    assert inner.precise_prefix.speculative_ttl_seconds == 0.5
    assert inner.precise_prefix == top.precise_prefix


@pytest.mark.parametrize(
    ("inner", "key"),
    [({"speculativeIndexing": "true"}, "speculativeIndexing"),
     ({"speculativeTTL": 2}, "speculativeTTL"),
     ({"speculativeTTL": "soon"}, "speculativeTTL")],
)
def test_a_wrong_speculative_key_in_indexer_config_fails_naming_its_path(
    inner: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError,
                       match=rf"^plugins\[0\]\.parameters\.indexerConfig\.{key}: (?!unknown)"):
        parse_config(one("precise-prefix-cache-scorer", indexerConfig=inner))


def test_a_speculative_ttl_in_both_places_fails_naming_both() -> None:
    both = r"^plugins\[0\]\.parameters\.speculativeTTL: .*indexerConfig\.speculativeTTL"
    with pytest.raises(ConfigError, match=both):
        parse_config(one("precise-prefix-cache-scorer", speculativeTTL="1s",
                         indexerConfig={"speculativeTTL": "1s"}))


@pytest.mark.parametrize(
    ("type_", "parameters"),
    [
        ("metrics-data-source", {"insecureSkipVerify": None, "port": None}),
        ("session-affinity-scorer", {"sessionIdConfig": None}),
        ("precise-prefix-cache-producer", {"indexerConfig": {"kvBlockIndexConfig": None}}),
        ("precise-prefix-cache-producer",
         {"indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": None}}}),
        ("load-aware-scorer", {"threshold": None}),
    ],
)
def test_a_null_value_loads_as_unset(type_: str, parameters: dict[str, Any]) -> None:
    """Go's JSON decoding leaves a field at its zero value for a null (``key:`` left empty in
    YAML), with no error, so llm-d loads it: so does this, as if the key were absent."""
    parse_config(one(type_, **parameters))
