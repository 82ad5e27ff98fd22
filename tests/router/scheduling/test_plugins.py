from __future__ import annotations

import random
from typing import Any

import pytest

from router.config.model import PluginConfig, ProfileConfig, builtin_strategy, parse_config
from router.config.strategies import STRATEGIES
from router.core.errors import ConfigError
from router.core.framework import Filter, Picker, Scorer
from router.scheduling.pickers import MaxScorePicker, RoundRobinPicker
from router.scheduling.plugins import PluginContext, build_profile, default_registry
from scorers.ttft_cost import TTFTCostParameters, TTFTCostScorer


def build(plugins: list[dict[str, Any]], refs: list[dict[str, Any]]) -> Any:
    config = parse_config(
        {"plugins": plugins, "schedulingProfiles": [{"name": "p", "plugins": refs}]}
    )
    assert config.plugins is not None and config.scheduling_profiles is not None
    return build_profile(
        config.plugins,
        config.scheduling_profiles[0],
        default_registry(),
        PluginContext(random.Random(1)),
    )


def test_weights_live_in_the_profile() -> None:
    profile = build(
        [{"type": "queue-scorer", "name": "q"}, {"type": "round-robin-picker"}],
        [{"pluginRef": "q", "weight": 2.5}, {"pluginRef": "round-robin-picker"}],
    )
    assert [(s.name, s.weight) for s in profile.scorers] == [("q", 2.5)]
    assert isinstance(profile.picker, RoundRobinPicker)


def test_default_picker_is_max_score() -> None:
    profile = build([{"type": "queue-scorer"}], [{"pluginRef": "queue-scorer"}])
    assert isinstance(profile.picker, MaxScorePicker)
    assert profile.scorers[0].weight == 1.0


@pytest.mark.parametrize(
    ("plugins", "refs", "message"),
    [
        ([{"type": "nope"}], [], "plugins[0].type: unknown plugin type 'nope'"),
        (
            [{"type": "queue-scorer", "parameters": {"x": 1}}],
            [],
            "plugins[0].parameters.x: unknown key",
        ),
        ([{"type": "queue-scorer"}], [{"pluginRef": "missing"}], "no plugin named 'missing'"),
        (
            [{"type": "ttft-cost-scorer",
              "parameters": {"recomputeWeight": 2.0, "recomputeWeightMax": 1.5}}],
            [],
            "recomputeWeightMax (1.5) is below recomputeWeight (2.0)",
        ),
        # Values keep their YAML types, as in the gateway's own sections: no coercion.
        (
            [{"type": "ttft-cost-scorer", "parameters": {"recomputeWeight": "2"}}],
            [],
            "plugins[0].parameters.recomputeWeight: Input should be a valid number",
        ),
        (
            [{"type": "load-aware-scorer", "parameters": {"threshold": True}}],
            [],
            "plugins[0].parameters.threshold: Input should be a valid integer",
        ),
        (
            [{"type": "no-hit-lru-scorer", "parameters": {"lruSize": "64"}}],
            [],
            "plugins[0].parameters.lruSize: Input should be a valid integer",
        ),
        (
            [{"type": "queue-scorer"}, {"type": "queue-scorer"}],
            [],
            "plugins[1].name: duplicate plugin name",
        ),
        (
            [{"type": "max-score-picker"}],
            [{"pluginRef": "max-score-picker", "weight": 1}],
            "only scorers take a weight",
        ),
        (
            [{"type": "max-score-picker"}, {"type": "random-picker"}],
            [{"pluginRef": "max-score-picker"}, {"pluginRef": "random-picker"}],
            "a profile has one picker",
        ),
    ],
)
def test_assembly_errors_name_the_key(
    plugins: list[dict[str, Any]], refs: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build(plugins, refs)
    assert message in str(info.value)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_builds(name: str) -> None:
    plugins, profile = builtin_strategy(name)
    built = build_profile(plugins, profile, default_registry(), PluginContext(random.Random(0)))
    assert built.picker is not None


class _Unrelated:
    """Has a type name but neither scores, filters nor picks."""

    type_name = "unrelated"


def test_a_plugin_of_no_known_kind_is_a_config_error_naming_the_profile_entry() -> None:
    registry = default_registry()
    registry.register("unrelated", lambda raw, ctx: _Unrelated())  # type: ignore[arg-type,return-value]
    config = parse_config(
        {
            "plugins": [{"type": "queue-scorer"}, {"type": "unrelated", "name": "odd"}],
            "schedulingProfiles": [
                {"name": "p", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "odd"}]}
            ],
        }
    )
    assert config.plugins is not None and config.scheduling_profiles is not None
    with pytest.raises(ConfigError) as info:
        build_profile(
            config.plugins, config.scheduling_profiles[0], registry,
            PluginContext(random.Random(1)),
        )
    message = str(info.value)
    assert "schedulingProfiles[0].plugins[1].pluginRef" in message
    assert "'odd'" in message and "not a scorer, filter or picker" in message


def test_every_registered_plugin_declares_its_type_name() -> None:
    registry = default_registry()
    context = PluginContext(random.Random(1))
    for name in registry.types():
        plugin = registry.create(PluginConfig(type=name), context, "plugins[0]")
        assert isinstance(plugin, Scorer | Filter | Picker)
        assert plugin.type_name == name


def test_registry_rejects_duplicates() -> None:
    registry = default_registry()
    with pytest.raises(ValueError):
        registry.register("queue-scorer", lambda raw, ctx: object())
    assert "prefix-cache-scorer" in registry.types()
    assert PluginConfig(type="x").ref == "x"
    assert ProfileConfig(name="p", plugins=[]).plugins == []


@pytest.mark.parametrize(
    ("plugin", "snake", "camel"),
    [
        ({"type": "ttft-cost-scorer", "parameters": {"recompute_weight": 2.0}},
         "recompute_weight", "recomputeWeight"),
        ({"type": "no-hit-lru-scorer", "parameters": {"lru_size": 64}}, "lru_size", "lruSize"),
    ],
)
def test_plugin_parameters_have_one_spelling(
    plugin: dict[str, Any], snake: str, camel: str
) -> None:
    """The documented camelCase only, as in the gateway's own sections: the Python field's
    snake_case name fails at its full path and says how the key is spelled."""
    with pytest.raises(ConfigError) as info:
        build([plugin], [])
    assert f"plugins[0].parameters.{snake}: unknown key" in str(info.value)
    assert camel in str(info.value)


def test_plugin_parameters_in_camel_case_load_and_code_builds_by_field_name() -> None:
    profile = build(
        [{"type": "ttft-cost-scorer", "parameters": {"recomputeWeight": 2.0,
                                                     "recomputeWeightMax": 3.0}}],
        [{"pluginRef": "ttft-cost-scorer"}],
    )
    assert isinstance(profile.scorers[0].scorer, TTFTCostScorer)
    assert TTFTCostParameters(recompute_weight=2.0).recompute_weight == 2.0
