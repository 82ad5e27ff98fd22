"""llm-d ``EndpointPickerConfig`` files, accepted as they are.

A config whose ``apiVersion`` is llm-d's (``llm-d.ai/v1alpha1``) or the Gateway API inference
extension's (``inference.networking.x-k8s.io/v1alpha1``) is translated into prefixgate's own
config before validation: plugins and profiles by router/config/llmd_plugins.py, and here the
top-level sections (``featureGates``, ``flowControl``, ``saturationDetector``, ``dataLayer``,
``requestHandler`` / ``parser``). prefixgate's own sections may sit alongside (``pool``,
``server``, ...) and win over what the translation derived. What has no counterpart fails,
naming it; what is accepted but ignored is listed in ``compatibility.ignored``, which the
gateway logs once at start-up. docs/llm-d-compatibility.md is the user's view of all this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from router.config.llmd_handlers import PD_TYPES, PREFILL_FIRST
from router.config.llmd_params import Notes, Params, State, duration_seconds, quantity
from router.config.llmd_plugins import LATE, apply
from router.core.errors import ConfigError

LLMD_API_VERSIONS = frozenset({"llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"})
_LLMD_KEYS = frozenset({
    "apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
    "flowControl", "requestHandler", "saturationDetector", "parser",
})
_GATE_IGNORED = {
    "haPopulateNonLeaderDatastore": "every gateway replica keeps its own view of the pool",
}
_DEFAULT_DETECTOR = "utilization-detector"
_SCHEDULING_TYPES = frozenset({
    "decode-filter", "prefill-filter", "queue-scorer", "kv-cache-utilization-scorer",
    "load-aware-scorer", "no-hit-lru-scorer", "prefix-cache-scorer",
    "precise-prefix-cache-scorer", "session-affinity-scorer", "inflight-scorer",
    "max-score-picker", "random-picker",
})


def is_llmd(data: Mapping[str, Any]) -> bool:
    return data.get("apiVersion") in LLMD_API_VERSIONS


def translate(data: Mapping[str, Any]) -> dict[str, Any]:
    """The llm-d config ``data`` as prefixgate's own config mapping (not yet validated)."""
    if data.get("kind", "EndpointPickerConfig") != "EndpointPickerConfig":
        raise ConfigError(f"kind: an llm-d config here is an EndpointPickerConfig, "
                          f"got {data.get('kind')!r}")
    state = State(Notes())
    _plugins(state, data.get("plugins"))
    plugins, profiles = _profiles(state, data.get("schedulingProfiles"))
    enabled = _feature_gates(state, data.get("featureGates"))
    flow = _flow_control(state, data.get("flowControl"), enabled)
    top = data.get("saturationDetector")
    if top is not None:
        flow["saturationDetector"] = _detector(state, top, "saturationDetector")
    elif "saturationDetector" not in flow and _DEFAULT_DETECTOR in state.detectors:
        # llm-d's pluginRef when none is given.
        flow["saturationDetector"] = dict(state.detectors[_DEFAULT_DETECTOR])
    state.sections["flowControl"] = _merge(state.sections.get("flowControl", {}), flow)
    _data_layer(state, data.get("dataLayer"))
    _parsers(state, data.get("requestHandler"), data.get("parser"))
    native: dict[str, Any] = {"plugins": plugins, "schedulingProfiles": profiles}
    for key, section in state.sections.items():
        native[key] = section
    for key, value in data.items():
        if key not in _LLMD_KEYS:
            own = native.get(key)
            if isinstance(own, dict) and isinstance(value, Mapping):
                native[key] = _merge(own, value)
            else:
                native[key] = value
    native["compatibility"] = {"source": data["apiVersion"], "ignored": state.notes.ignored}
    return native


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: must be a list")
    return value


def _plugins(state: State, raw: Any) -> None:
    specs: list[tuple[int, str, str, Any]] = []
    for i, spec in enumerate(_list(raw, "plugins")):
        where = f"plugins[{i}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        extra = sorted(set(spec) - {"type", "name", "parameters"})
        if extra:
            raise ConfigError(f"{where}.{extra[0]}: unknown key")
        plugin_type = spec.get("type")
        if not isinstance(plugin_type, str) or not plugin_type:
            raise ConfigError(f"{where}.type: required")
        name = spec.get("name") or plugin_type
        if name in state.types:
            raise ConfigError(f"{where}.name: duplicate plugin name {name!r}")
        state.types[name] = plugin_type
        specs.append((i, name, plugin_type, spec.get("parameters")))
    # Scorers that read a producer go last, so the producer is known whatever the order.
    for i, name, plugin_type, parameters in sorted(specs, key=lambda s: s[2] in LATE):
        apply(state, name, plugin_type, Params(parameters, f"plugins[{i}].parameters",
                                               plugin_type, state.notes))


def _profiles(state: State, raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Native plugins and profiles; a disaggregating handler names prefill and decode."""
    if raw is None:  # llm-d's default: one profile of every filter, scorer and picker
        raw = [{"name": "default", "plugins": [
            {"pluginRef": name} for name in state.types
            if state.native.get(name, {}).get("type") in _SCHEDULING_TYPES
        ]}]
    profiles: list[dict[str, Any]] = []
    for j, profile in enumerate(_list(raw, "schedulingProfiles")):
        where = f"schedulingProfiles[{j}]"
        built = _profile(state, profile, where)
        if any(p["name"] == built["name"] for p in profiles):
            raise ConfigError(f"{where}.name: duplicate profile name {built['name']!r}")
        profiles.append(built)
    if not profiles:
        raise ConfigError("schedulingProfiles: at least one profile is needed")
    if state.handler == "disagg-profile-handler":
        profiles = _disagg_profiles(state, profiles)
    elif len(profiles) > 1:
        raise ConfigError(f"schedulingProfiles: {state.handler or 'single-profile-handler'} "
                          f"runs one profile, got {len(profiles)} (disagg-profile-handler "
                          "runs prefill and decode)")
    plugins = [state.native[name] for name in state.types if name in state.native]
    return plugins, profiles


def _weight(ref: Mapping[str, Any], at: str) -> None:
    """Checked here, naming the profile as the file has it (disaggregation reorders them)."""
    weight = ref.get("weight")
    if weight is None:  # llm-d: unset, the default weight
        return
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not number or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"{at}.weight: must be a finite number >= 0, got {weight!r}")


def _profile(state: State, profile: Any, where: str) -> dict[str, Any]:
    if not isinstance(profile, Mapping) or not isinstance(profile.get("name"), str):
        raise ConfigError(f"{where}.name: required")
    extra = sorted(set(profile) - {"name", "plugins"})
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: unknown key")
    refs = []
    for k, ref in enumerate(_list(profile.get("plugins"), f"{where}.plugins")):
        at = f"{where}.plugins[{k}]"
        if not isinstance(ref, Mapping) or not isinstance(ref.get("pluginRef"), str):
            raise ConfigError(f"{at}.pluginRef: required")
        extra = sorted(set(ref) - {"pluginRef", "weight"})
        if extra:
            raise ConfigError(f"{at}.{extra[0]}: unknown key")
        name = ref["pluginRef"]
        if name not in state.types:
            raise ConfigError(f"{at}.pluginRef: no plugin named {name!r}")
        native = state.native.get(name)
        if native is None or native["type"] not in _SCHEDULING_TYPES:
            raise ConfigError(f"{at}.pluginRef: {name!r} ({state.types[name]}) is not a "
                              "filter, scorer or picker")
        _weight(ref, at)
        refs.append({k: v for k, v in ref.items() if k in ("pluginRef", "weight")})
    return {"name": profile["name"], "plugins": refs}


def _disagg_profiles(state: State, profiles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode profile (the gateway's main one) and, when a request can be prefilled
    elsewhere, the prefill profile, as llm-d's disagg handler runs them."""
    params = state.handler_params
    by_name = {p["name"]: p for p in profiles}
    decider = params["decider"]
    # prefill-first (no decider): every request is prefilled, if a prefill profile exists.
    always = params["order"] == PREFILL_FIRST and params["profiles"]["prefill"] in by_name
    out = []
    for role in ("decode", "prefill") if decider or always else ("decode",):
        wanted = params["profiles"][role]
        if wanted not in by_name:
            raise ConfigError(f"{params['profile_at'][role]}: no scheduling profile named "
                              f"{wanted!r}")
        out.append({**by_name[wanted], "name": role})
    pd = state.section("disaggregation")
    if decider:
        if state.types.get(decider) not in PD_TYPES:
            raise ConfigError(f"{params['decider_at']}: no decider plugin named {decider!r}")
        tokens = state.deciders[decider]
        pd["enabled"] = tokens != 0  # llm-d: nonCachedTokens 0 turns disaggregation off
        pd["nonCachedTokens"] = max(0, tokens)  # -1 (always): from 0 uncached tokens on
    elif always:
        pd["enabled"], pd["nonCachedTokens"] = True, 0
    else:
        pd["enabled"] = False
        state.notes.ignore(params["decider_at"], "not set: prefill/decode disaggregation is "
                           "off and only the decode profile runs, as in llm-d")
    return out


def _feature_gates(state: State, raw: Any) -> bool:
    """Whether flow control is on (the ``flowControl`` gate, as in llm-d)."""
    enabled = False
    for i, gate in enumerate(_list(raw, "featureGates")):
        if gate == "flowControl":
            enabled = True
        elif gate in _GATE_IGNORED:
            state.notes.ignore(f"featureGates[{i}] ({gate})", _GATE_IGNORED[gate])
        else:
            known = ", ".join(["flowControl", *_GATE_IGNORED])
            raise ConfigError(f"featureGates[{i}]: unknown feature gate {gate!r} "
                              f"(known here: {known})")
    return enabled


def _flow_control(state: State, raw: Any, enabled: bool) -> dict[str, Any]:
    if raw is not None and not enabled:
        state.notes.ignore("flowControl", "flow control is off without the flowControl "
                           "feature gate, as in llm-d")
    p = Params(raw, "flowControl", "flowControl", state.notes)
    out: dict[str, Any] = {"enabled": enabled}
    for key in ("maxBytes", "maxRequests"):
        if p.has(key):
            out[key] = quantity(p.get(key, object, None), p.at(key))
    if p.has("defaultRequestTTL"):
        out["defaultRequestTTL"] = duration_seconds(
            p.get("defaultRequestTTL", object, None), p.at("defaultRequestTTL")
        )
    p.ignore("a request for a model no endpoint serves is answered at once",
             noEndpointRequestTTL=duration_seconds)
    p.ignore("priorities below every band share the default band",
             defaultNegativePriorityBand=dict)
    if p.has("defaultPriorityBand"):
        out["defaultBand"] = _band(state, p.sub("defaultPriorityBand"), with_priority=False)
    bands = _list(p.get("priorityBands", list, []), p.at("priorityBands"))
    if bands:
        out["priorityBands"] = [
            _band(state, Params(b, f"{p.at('priorityBands')}[{i}]", "flowControl", state.notes),
                  with_priority=True)
            for i, b in enumerate(bands)
        ]
    ref = p.get("usageLimitPolicyPluginRef", str, "")
    if ref and ref not in state.types:
        raise ConfigError(f"{p.at('usageLimitPolicyPluginRef')}: no plugin named {ref!r}")
    if p.has("saturationDetector"):
        out["saturationDetector"] = _detector(state, p.get("saturationDetector", object, None),
                                              p.at("saturationDetector"))
    if p.get("enableEviction", bool, False):
        raise ConfigError(f"{p.at('enableEviction')}: requests already sent upstream are "
                          "never evicted here; remove it")
    p.done()
    return out


def _band(state: State, p: Params, with_priority: bool) -> dict[str, Any]:
    band: dict[str, Any] = {}
    if with_priority:
        if not p.has("priority"):
            raise ConfigError(f"{p.at('priority')}: required")
        band["priority"] = p.get("priority", int, 0)
    for key in ("maxBytes", "maxRequests"):
        if p.has(key):
            band[key] = quantity(p.get(key, object, None), p.at(key))
    ref = p.get("fairnessPolicyRef", str, "")
    if ref:
        if ref not in state.fairness:
            raise ConfigError(f"{p.at('fairnessPolicyRef')}: no fairness policy plugin named "
                              f"{ref!r}")
        band.update(state.fairness[ref])
    ordering = p.get("orderingPolicyRef", str, "")
    if ordering and ordering not in state.orderings:
        raise ConfigError(f"{p.at('orderingPolicyRef')}: no fcfs-ordering-policy plugin named "
                          f"{ordering!r} (requests of a flow are served first come, first "
                          "served)")
    p.done()
    return band


def _detector(state: State, raw: Any, where: str) -> dict[str, Any]:
    p = Params(raw, where, "saturationDetector", state.notes)
    ref = p.get("pluginRef", str, "")
    p.done()
    if ref not in state.detectors:
        raise ConfigError(f"{where}.pluginRef: no utilization-detector or concurrency-detector "
                          f"plugin named {ref!r}")
    return dict(state.detectors[ref])


def _refs(state: State, raw: Any, where: str) -> None:
    p = Params(raw, where, "reference", state.notes)
    ref = p.get("pluginRef", str, "")
    p.ignore_all("not used by prefixgate")
    if ref not in state.types:
        raise ConfigError(f"{where}.pluginRef: no plugin named {ref!r}")


def _data_layer(state: State, raw: Any) -> None:
    if raw is None:
        return
    p = Params(raw, "dataLayer", "dataLayer", state.notes)
    p.get("injectDefaults", bool, True)
    for i, source in enumerate(_list(p.get("sources", list, []), p.at("sources"))):
        at = f"{p.at('sources')}[{i}]"
        src = Params(source, at, "dataLayer", state.notes)
        _refs(state, {"pluginRef": src.get("pluginRef", str, "")}, at)
        for k, extractor in enumerate(_list(src.get("extractors", list, []), at)):
            _refs(state, extractor, f"{at}.extractors[{k}]")
        src.done()
    if p.has("discovery"):
        _refs(state, p.get("discovery", object, None), p.at("discovery"))
    for key in ("peerDiscovery", "crossReplicaSyncerPluginRef"):
        if p.has(key):
            raise ConfigError(f"{p.at(key)}: gateway replicas share their state through Redis "
                              "here (prefixIndex.backend: redis); remove it")
    p.ignore("replicas share state through Redis as they go",
             crossReplicaSyncInterval=duration_seconds)
    p.done()


def _parsers(state: State, handler: Any, parser: Any) -> None:
    if handler is not None:
        p = Params(handler, "requestHandler", "requestHandler", state.notes)
        for i, ref in enumerate(_list(p.get("parsers", list, []), p.at("parsers"))):
            _refs(state, ref, f"{p.at('parsers')}[{i}]")
        p.done()
    if parser is not None:
        _refs(state, parser, "parser")
