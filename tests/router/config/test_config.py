from __future__ import annotations

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
