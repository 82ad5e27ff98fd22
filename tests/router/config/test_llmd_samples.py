"""Configs shaped like llm-d-router's sample EndpointPickerConfigs (deploy/config): each loads,
or is refused naming the plugin prefixgate has no counterpart for.

The configs are written for these tests, one per sample shape; none is a copy of a sample.
docs/llm-d-compatibility.md lists the samples and their outcome.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.app import build_gateway
from router.config.model import parse_config
from router.core.errors import ConfigError

LLMD = "llm-d.ai/v1alpha1"
GIE = "inference.networking.x-k8s.io/v1alpha1"


def epp(plugins: list[dict[str, Any]], *profiles: tuple[str, list[Any]], api: str = LLMD,
        **extra: Any) -> dict[str, Any]:
    """An EndpointPickerConfig; a profile is (name, [plugin name or (name, weight)])."""
    built = [{"name": name, "plugins": [
        {"pluginRef": r[0], "weight": r[1]} if isinstance(r, tuple) else {"pluginRef": r}
        for r in refs]} for name, refs in profiles]
    return {"apiVersion": api, "kind": "EndpointPickerConfig", "plugins": plugins,
            "schedulingProfiles": built, **extra}


def t(type_: str, **parameters: Any) -> dict[str, Any]:
    return {"type": type_, "parameters": parameters} if parameters else {"type": type_}


ROUTE = ["decode-filter", ("prefix-cache-scorer", 3), "max-score-picker"]
PD_PROFILES = (
    ("prefill", ["prefill-filter", ("prefix-cache-scorer", 2), ("queue-scorer", 1)]),
    ("decode", ["decode-filter", ("prefix-cache-scorer", 2), ("queue-scorer", 1)]),
)

LOADS = {
    "epp-config": epp(
        [t("prefix-cache-scorer"), t("decode-filter"), t("max-score-picker"),
         t("single-profile-handler")], ("default", ROUTE)),
    "dp-epp-config": epp(
        [t("prefix-cache-scorer"), t("decode-filter"), t("max-score-picker"),
         t("data-parallel-profile-handler", primaryPort=8200)], ("default", ROUTE)),
    "epp-estimate-prefix-cache-config": epp(
        [t("single-profile-handler"), t("decode-filter"), t("prefix-cache-scorer"),
         t("load-aware-scorer"), t("max-score-picker")],
        ("default", [*ROUTE, ("load-aware-scorer", 1.0)])),
    "epp-burst-prefix-cache-config": epp(
        [t("token-producer", modelName="m", vllm={"url": "http://127.0.0.1:9"}),
         t("single-profile-handler"), t("decode-filter"),
         t("burst-prefix-cache-producer", windowDurationMs=50, maxPerReplica=-1,
           minColocateBlocks=2),
         t("prefix-cache-scorer", prefixMatchInfoProducerName="burst-prefix-cache-producer"),
         t("load-aware-scorer"), t("max-score-picker")],
        ("default", [*ROUTE, "load-aware-scorer"])),
    "epp-precise-prefix-cache-config": epp(
        [t("token-producer", modelName="m", vllm={"url": "http://127.0.0.1:9"}),
         t("endpoint-notification-source"), t("metrics-data-source"),
         t("core-metrics-extractor"), t("single-profile-handler"), t("decode-filter"),
         t("precise-prefix-cache-producer", tokenProcessorConfig={"blockSize": 32},
           indexerConfig={"kvBlockIndexConfig": {"enableMetrics": True}}),
         t("prefix-cache-scorer", prefixMatchInfoProducerName="precise-prefix-cache-producer"),
         t("queue-scorer"), t("max-score-picker")],
        ("default", [*ROUTE, "queue-scorer"]),
        dataLayer={"sources": [
            {"pluginRef": "metrics-data-source",
             "extractors": [{"pluginRef": "core-metrics-extractor"}]},
            {"pluginRef": "endpoint-notification-source",
             "extractors": [{"pluginRef": "precise-prefix-cache-producer"}]}]}),
    "sim-epp-no-hit-lru": epp(
        [t("precise-prefix-cache-producer", tokenProcessorConfig={"blockSizeTokens": 8}),
         t("prefix-cache-scorer", prefixMatchInfoProducerName="precise-prefix-cache-producer"),
         t("no-hit-lru-scorer", lruSize=64), t("decode-filter"), t("max-score-picker"),
         t("single-profile-handler")],
        ("default", [*ROUTE, ("no-hit-lru-scorer", 1)])),
    "pd-epp-config": epp(
        [t("approx-prefix-cache-producer", maxPrefixTokensToMatch=8192,
           lruCapacityPerServer=5000),
         t("prefix-cache-scorer"), t("queue-scorer"), t("prefill-filter"), t("decode-filter"),
         t("max-score-picker"),
         # The handler before the decider it names, as in the sample.
         t("disagg-profile-handler", deciders={"prefill": "prefix-based-pd-decider"}),
         t("prefix-based-pd-decider", nonCachedTokens=32)],
        *PD_PROFILES),
    "sim-program-aware-config": epp(
        [t("program-aware-fairness"), t("queue-scorer"), t("max-score-picker"),
         t("single-profile-handler")],
        ("default", ["queue-scorer", "max-score-picker"]), api=GIE,
        featureGates=["flowControl"],
        flowControl={"defaultPriorityBand": {"fairnessPolicyRef": "program-aware-fairness"}}),
    # The GIE/llm-d chart's built-in config: no handler, no picker, scrape settings.
    "chart default-plugins": epp(
        [t("queue-scorer"), t("kv-cache-utilization-scorer"), t("prefix-cache-scorer"),
         t("metrics-data-source", scheme="http", path="/metrics", insecureSkipVerify=True),
         t("core-metrics-extractor")],
        ("default", [("queue-scorer", 2), ("kv-cache-utilization-scorer", 2),
                     ("prefix-cache-scorer", 3)]), api=GIE),
}


@pytest.mark.parametrize("name", sorted(LOADS))
def test_sample_shapes_load_and_build(name: str) -> None:
    config = parse_config(LOADS[name])
    assert config.compatibility is not None
    build_gateway(config)


def test_the_p_d_sample_turns_disaggregation_on_with_its_decider() -> None:
    config = parse_config(LOADS["pd-epp-config"])
    assert (config.disaggregation.enabled, config.disaggregation.non_cached_tokens) == (True, 32)
    assert config.prefix_index.max_blocks_per_request is not None


REFUSED = {
    "epp-mm-embeddings-cache-config": (
        [t("mm-embeddings-cache-producer", cacheSizeInMB=64), t("mm-embeddings-cache-scorer")],
        r"plugins\[0\]\.type: llm-d plugin 'mm-embeddings-cache-producer' has no counterpart"),
    "pd-topology-epp-config": (
        [t("prefill-filter"), t("topology-extractor"), t("topology-affinity-filter")],
        r"plugins\[1\]\.type: llm-d plugin 'topology-extractor' has no counterpart"),
    "probabilistic-admitter-epp-config": (
        [t("probabilistic-admitter"), t("random-picker")],
        r"plugins\[0\]\.type: llm-d plugin 'probabilistic-admitter' has no counterpart"),
    "sim-e-pd-epp-config": (
        [t("encode-filter"), t("decode-filter")],
        r"plugins\[0\]\.type: llm-d plugin 'encode-filter' has no counterpart.*encode stage"),
    "sim-epp-gpu-config": (
        [t("dcgm-data-source", port=9400), t("dcgm-extractor")],
        r"plugins\[0\]\.type: llm-d plugin 'dcgm-data-source' has no counterpart"),
    "soft-reflective-ceiling-epp-config": (
        [t("queue-scorer"), t("soft-reflective-ceiling-policy")],
        r"plugins\[1\]\.type: llm-d plugin 'soft-reflective-ceiling-policy' has no counterpart"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_samples_without_a_counterpart_are_refused_naming_the_plugin(name: str) -> None:
    plugins, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message):
        parse_config(epp(plugins, ("default", [])))
