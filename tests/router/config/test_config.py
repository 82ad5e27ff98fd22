from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from router.config.model import load_config, parse_config
from router.core.errors import ConfigError

EXAMPLE = """
apiVersion: prefixgate.dev/v1alpha1
kind: EndpointPickerConfig
pool:
  endpoints:
    - url: http://127.0.0.1:8001
    - url: http://127.0.0.1:8002
      role: decode
      models: [m]
  metricsScrape: {intervalSeconds: 0.05}
plugins:
  - type: prefix-cache-scorer
  - type: queue-scorer
    name: q
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - {pluginRef: prefix-cache-scorer, weight: 3}
      - {pluginRef: q, weight: 2}
      - {pluginRef: max-score-picker}
"""


def test_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    assert config.pool.endpoints[1].role == "decode"
    assert config.pool.metrics_scrape.interval_seconds == 0.05
    assert config.scheduling_profiles is not None
    assert config.scheduling_profiles[0].plugins[1].weight == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pool": {"endpointz": []}}, "pool.endpointz: unknown key"),
        ({"pool": {"endpoints": [{"url": "ftp://x"}]}}, "pool.endpoints[0].url"),
        ({"pool": {"endpoints": [{"url": "http://a:1", "role": "x"}]}}, "pool.endpoints[0].role"),
        (
            {"pool": {"metricsScrape": {"intervalSeconds": -1}}},
            "pool.metricsScrape.intervalSeconds",
        ),
        ({"prefixIndex": {"blockBytes": 3}}, "prefixIndex.blockBytes"),
        ({"server": {"workers": 0}}, "server.workers"),
        ({"strategy": "nope"}, "strategy"),
        ({"plugins": []}, "schedulingProfiles go together"),
        (
            {
                "plugins": [{"type": "queue-scorer"}, {"type": "prefill-filter"}],
                "schedulingProfiles": [
                    {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
                    {"name": "main", "plugins": [{"pluginRef": "queue-scorer"}]},
                ],
            },
            "schedulingProfiles: 2 profiles (prefill, main), but without disaggregation",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "disaggregation": {"enabled": True},
                "schedulingProfiles": [
                    {"name": n, "plugins": [{"pluginRef": "queue-scorer"}]}
                    for n in ("prefill", "decode", "spare")
                ],
            },
            "others: spare",
        ),
        (
            {"pool": {"endpoints": [{"url": "http://a:1"}, {"url": "http://a:1/"}]}},
            "duplicate endpoints: a:1",
        ),
    ],
)
def test_bad_config_names_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pool: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"proxy": {"firstByteTimeoutSeconds": float("inf")}}, r"proxy\.firstByteTimeoutSeconds"),
        ({"flowControl": {"defaultRequestTTL": float("inf")}}, r"flowControl\.defaultRequestTTL"),
        ({"sessionAffinity": {"ttlSeconds": float("inf")}}, r"sessionAffinity\.ttlSeconds"),
    ],
)
def test_no_setting_takes_an_infinite_number(section: dict[str, Any], key: str) -> None:
    """A bound like ``ge=0`` lets infinity through: every number in the config is finite."""
    with pytest.raises(ConfigError, match=key):
        parse_config(section)


@pytest.mark.parametrize("weight", [float("inf"), float("nan")])
def test_a_weight_must_be_finite(weight: float) -> None:
    """An infinite weight turns a zero score into NaN (inf * 0) and the sum into nonsense."""
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins\[0\]\.weight"):
        parse_config({
            "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
            "schedulingProfiles": [{"name": "default", "plugins": [
                {"pluginRef": "queue-scorer", "weight": weight},
                {"pluginRef": "max-score-picker"},
            ]}],
        })


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prefixIndex": {"backend": "redis"}}, "prefixIndex.url: the redis backend needs url"),
        ({"strategy": "nope"}, "invalid config: strategy: unknown 'nope'"),
        ({"discovery": {"labelSelector": {"a": "b"}}}, "discovery.targetPorts: needed with"),
        ({"precisePrefix": {"index": {"namespace": ""}}}, "precisePrefix.index.namespace: must"),
        ({"auth": {"apiKeys": [{"tenant": "t"}]}}, "auth.apiKeys[0]: give key or keyEnv"),
    ],
)
def test_a_check_across_keys_names_the_full_key_path(data: dict[str, Any], message: str) -> None:
    """A section's own check names the key inside the section: the message carries its whole
    path, as a single key's error does, without pydantic's "Value error, " prefix."""
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)
    assert "Value error" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"server": {"accessLog": "no"}}, "server.accessLog"),
        ({"pool": {"outlierDetection": {"enabled": "false"}}}, "pool.outlierDetection.enabled"),
        ({"server": {"port": "8080"}}, "server.port"),
        ({"server": {"workers": True}}, "server.workers"),
    ],
)
def test_values_are_not_coerced_from_another_type(data: dict[str, Any], key: str) -> None:
    """A quoted "false" or "no" is a string in YAML: reading it as a bool guesses what the
    operator meant, and a bool read as the number 1 is a typo nobody sees."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_config(data)


def test_the_longest_ejection_is_not_shorter_than_the_first() -> None:
    with pytest.raises(ConfigError, match=r"pool\.outlierDetection\.maxEjectionSeconds"):
        parse_config({"pool": {"outlierDetection": {
            "baseEjectionSeconds": 60, "maxEjectionSeconds": 30,
        }}})
    config = parse_config({"pool": {"outlierDetection": {
        "baseEjectionSeconds": 30, "maxEjectionSeconds": 30,
    }}})
    assert config.pool.outlier_detection.max_ejection_seconds == 30


@pytest.mark.parametrize("namespace", ["", "a b", "{tag}"])
def test_prefix_index_namespace_is_checked_at_load(namespace: str) -> None:
    """Redis key tags are built from it: it fails at load, not when the first store opens."""
    with pytest.raises(ConfigError, match=r"prefixIndex\.namespace"):
        parse_config({"prefixIndex": {"namespace": namespace}})


def test_keys_have_one_spelling() -> None:
    """The documented camelCase only: a snake_case key (the Python field's name) is unknown,
    so one config cannot spell a key two ways in two places."""
    with pytest.raises(ConfigError, match=r"server\.max_body_bytes: unknown key"):
        parse_config({"server": {"max_body_bytes": 4096}})


def test_the_servers_keep_alive_is_configurable_within_bounds() -> None:
    """How long an idle client connection stays open: longer than the load balancer's own
    idle timeout in front of the gateway, or the balancer reuses a connection the gateway is
    closing. 30 s unless set; a string, a bool, 0 or a day are refused, naming the key."""
    assert parse_config({}).server.keep_alive_seconds == 30.0
    assert parse_config({"server": {"keepAliveSeconds": 75}}).server.keep_alive_seconds == 75.0
    assert parse_config({"server": {"keepAliveSeconds": 2.5}}).server.keep_alive_seconds == 2.5
    for bad in ("75", True, 0, 0.5, 86_400, float("inf")):
        with pytest.raises(ConfigError, match=r"server\.keepAliveSeconds"):
            parse_config({"server": {"keepAliveSeconds": bad}})
