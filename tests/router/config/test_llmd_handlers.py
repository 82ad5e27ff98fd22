"""llm-d's profile handlers and P/D deciders (router/config/llmd_handlers.py) and the profiles
they pick (router/config/llmd.py). Every config is written for the test."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.model import parse_config
from router.core.errors import ConfigError

LLMD = "llm-d.ai/v1alpha1"


def pd(handler: dict[str, Any], *extra: dict[str, Any],
       names: tuple[str, str] = ("prefill", "decode")) -> dict[str, Any]:
    """Prefill and decode profiles (named ``names``), a decider named ``pd`` and ``handler``."""
    return {
        "apiVersion": LLMD,
        "plugins": [handler, {"type": "prefix-based-pd-decider", "name": "pd",
                              "parameters": {"nonCachedTokens": 64}},
                    {"type": "prefill-filter"}, {"type": "decode-filter"},
                    {"type": "queue-scorer"}, *extra],
        "schedulingProfiles": [
            {"name": names[0], "plugins": [{"pluginRef": "prefill-filter"},
                                           {"pluginRef": "queue-scorer", "weight": 2}]},
            {"name": names[1], "plugins": [{"pluginRef": "decode-filter"}]},
        ],
    }


def disagg(**parameters: Any) -> dict[str, Any]:
    return {"type": "disagg-profile-handler", "parameters": parameters}


def test_pd_profile_handler_is_read_as_the_disagg_handler_it_was_renamed_to() -> None:
    """llm-d still registers the deprecated pd-profile-handler: flat profile names, and a
    decider named by deciderPluginName (default: a plugin named prefix-based-pd-decider)."""
    handler: dict[str, Any] = {"type": "pd-profile-handler", "parameters": {
        "prefillProfile": "p", "decodeProfile": "d", "deciderPluginName": "pd",
        "prefixPluginName": "prefix-cache-scorer", "primaryPort": 8000}}
    config = parse_config(pd(handler, names=("p", "d")))
    assert (config.disaggregation.enabled, config.disaggregation.non_cached_tokens) == (True, 64)
    assert config.scheduling_profiles is not None
    assert [p.name for p in config.scheduling_profiles] == ["decode", "prefill"]
    assert config.compatibility is not None
    assert any("prefixPluginName" in n for n in config.compatibility.ignored)
    default = pd({"type": "pd-profile-handler"})
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.deciderPluginName: no "
                                          r"decider plugin named 'prefix-based-pd-decider'"):
        parse_config(default)
    default["plugins"][1]["name"] = "prefix-based-pd-decider"
    assert parse_config(default).disaggregation.enabled
    handler["parameters"]["primaryPort"] = 70000
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.primaryPort: .*65535"):
        parse_config(pd(handler, names=("p", "d")))


def test_disagg_handler_takes_llm_d_s_deprecated_flat_parameters_but_not_mixed() -> None:
    flat = disagg(prefillProfile="p", decodeProfile="d", deciderPluginName="pd")
    config = parse_config(pd(flat, names=("p", "d")))
    assert config.disaggregation.enabled
    preferred = disagg(prefillDeciderPluginName="pd", deciderPluginName="nope")
    assert parse_config(pd(preferred)).disaggregation.enabled, "the prefill name wins"
    mixed = disagg(prefillProfile="p", deciders={"prefill": "pd"})
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.prefillProfile: .*mixed"):
        parse_config(pd(mixed, names=("p", "d")))
    encode = disagg(encodeDeciderPluginName="pd")
    with pytest.raises(ConfigError, match=r"parameters\.encodeDeciderPluginName: .*encode"):
        parse_config(pd(encode))


def test_disagg_handler_without_a_prefill_decider_runs_the_decode_profile_alone() -> None:
    """As in llm-d: no deciders.prefill means P/D disaggregation is off, not an error."""
    config = parse_config(pd(disagg()))
    assert not config.disaggregation.enabled
    assert config.scheduling_profiles is not None
    assert [p.name for p in config.scheduling_profiles] == ["decode"]
    assert config.compatibility is not None
    assert any("deciders.prefill" in n for n in config.compatibility.ignored)


def test_stage_order_is_llm_d_s_enum() -> None:
    first = parse_config(pd(disagg(stageOrder="prefill-first")))
    assert (first.disaggregation.enabled, first.disaggregation.non_cached_tokens) == (True, 0), \
        "prefill-first prefills every request"
    assert parse_config(pd(disagg(stageOrder="decode_first",
                                  deciders={"prefill": "pd"}))).disaggregation.enabled
    with pytest.raises(ConfigError, match=r"stageOrder: unknown stage order 'sideways'"):
        parse_config(pd(disagg(stageOrder="sideways")))
    with pytest.raises(ConfigError, match=r"parameters\.deciders\.prefill: .*prefill-first"):
        parse_config(pd(disagg(stageOrder="prefill-first", deciders={"prefill": "pd"})))


def test_a_second_profile_handler_fails_naming_it() -> None:
    config = pd(disagg(deciders={"prefill": "pd"}), {"type": "single-profile-handler"})
    with pytest.raises(ConfigError, match=r"plugins\[5\]\.type: a second profile handler"):
        parse_config(config)


def test_duplicate_profile_names_fail() -> None:
    config = pd(disagg(deciders={"prefill": "pd"}), names=("decode", "decode"))
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[1\]\.name: duplicate profile"):
        parse_config(config)
