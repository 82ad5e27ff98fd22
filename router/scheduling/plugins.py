"""The plugin registry (type name -> factory) and config-driven assembly of a profile.

Weights live in the profile, outside the scorers, as in llm-d's EndpointPickerConfig. Each
factory validates its own parameters strictly, so a typo in ``parameters`` fails at start-up
naming the plugin and the key. A factory builds a :data:`Plugin` (a filter, scorer or picker,
each declaring its ``type_name``); a profile entry that names anything else is a config error,
not a plugin silently left out.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from router.config.model import PluginConfig, ProfileConfig, format_validation_error
from router.core.errors import ConfigError
from router.core.framework import (
    Filter,
    Picker,
    Plugin,
    SchedulingProfile,
    Scorer,
    WeightedScorer,
)
from router.core.strict import Strict
from router.estimators.calibration import Calibrator
from router.scheduling.filters import DECODE_FILTER, PREFILL_FILTER, decode_filter, prefill_filter
from router.scheduling.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker
from scorers.inflight import InFlightScorer
from scorers.kv_cache_utilization import KVCacheUtilizationScorer
from scorers.load_aware import LoadAwareParameters, LoadAwareScorer
from scorers.no_hit_lru import NoHitLRUParameters, NoHitLRUScorer
from scorers.precise_prefix_cache import PrecisePrefixCacheScorer, PreciseScores
from scorers.prefix_cache import PrefixCacheScorer
from scorers.queue import QueueScorer
from scorers.session_affinity import SessionAffinityScorer
from scorers.session_hash import SessionHashScorer
from scorers.ttft_cost import TTFTCostParameters, TTFTCostScorer


@dataclass(frozen=True, slots=True)
class PluginContext:
    """Shared services a factory may hand to its plugin."""

    rng: random.Random
    calibrator: Calibrator = field(default_factory=Calibrator)
    # The precise prefix tracker, when precise routing is on (router.precise.routing).
    precise: PreciseScores | None = None


Factory = Callable[[Mapping[str, Any], PluginContext], Plugin]


@runtime_checkable
class ForgetsEndpoints(Protocol):
    """A plugin that keeps state per endpoint (no-hit-lru-scorer's order): told when an
    endpoint leaves the pool, as the index and the other stores are, so that a pod at the
    same address later is not taken for the one that left."""

    async def forget_endpoint(self, endpoint_id: str) -> None: ...


def endpoint_forgetters(
    profiles: Iterable[SchedulingProfile | None],
) -> list[Callable[[str], Awaitable[None]]]:
    """The forget hooks of the profiles' scorers that keep state per endpoint."""
    return [
        ws.scorer.forget_endpoint
        for profile in profiles
        if profile is not None
        for ws in profile.scorers
        if isinstance(ws.scorer, ForgetsEndpoints)
    ]


class NoParameters(Strict):
    pass


M = TypeVar("M", bound=BaseModel)


def parameters(model: type[M], raw: Mapping[str, Any]) -> M:
    """Validate a plugin's ``parameters`` mapping against its model (used by factories).

    Keys by their documented camelCase only, as parse_config reads the gateway's own sections,
    so that one config cannot spell a key two ways; Python code still builds the models by
    field name (populate_by_name)."""
    try:
        return model.model_validate(dict(raw), by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _with_spelling(exc, model) from None


def _with_spelling(error: ValidationError, model: type[BaseModel]) -> ValidationError:
    """``error`` with each unknown key that is a field's Python name saying how it is spelled."""
    aliases = {name: field.alias or name for name, field in model.model_fields.items()}
    details: list[InitErrorDetails] = []
    for item in error.errors():
        key = item["loc"][0] if len(item["loc"]) == 1 else None  # the models are flat
        alias = aliases.get(key) if isinstance(key, str) else None
        kind: str | PydanticCustomError = item["type"]
        if item["type"] == "extra_forbidden" and alias is not None and alias != key:
            kind = PydanticCustomError(
                "spelling", "unknown key (spelled {alias})", {"alias": alias}
            )
        detail = InitErrorDetails(type=kind, loc=item["loc"], input=item["input"])
        if "ctx" in item and not isinstance(kind, PydanticCustomError):
            detail["ctx"] = item["ctx"]
        details.append(detail)
    return ValidationError.from_exception_data(error.title, details)


class PluginRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, type_name: str, factory: Factory) -> None:
        if type_name in self._factories:
            raise ValueError(f"plugin type {type_name!r} is already registered")
        self._factories[type_name] = factory

    def types(self) -> list[str]:
        return sorted(self._factories)

    def create(self, config: PluginConfig, context: PluginContext, where: str) -> Plugin:
        factory = self._factories.get(config.type)
        if factory is None:
            raise ConfigError(
                f"{where}.type: unknown plugin type {config.type!r} "
                f"(known: {', '.join(self.types())})"
            )
        try:
            return factory(config.parameters, context)
        except ValidationError as exc:
            raise ConfigError(
                f"invalid config: {format_validation_error(exc, f'{where}.parameters')}"
            ) from exc


def _simple(cls: Callable[[], Plugin]) -> Factory:
    def factory(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
        parameters(NoParameters, raw)
        return cls()

    return factory


def _seeded(cls: Callable[[random.Random], Plugin]) -> Factory:
    def factory(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
        parameters(NoParameters, raw)
        return cls(context.rng)

    return factory


def _ttft_cost(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
    return TTFTCostScorer(context.calibrator, parameters(TTFTCostParameters, raw), context.precise)


def _precise(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
    parameters(NoParameters, raw)
    return PrecisePrefixCacheScorer(context.precise)


def _load_aware(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
    return LoadAwareScorer(parameters(LoadAwareParameters, raw))


def _no_hit_lru(raw: Mapping[str, Any], context: PluginContext) -> Plugin:
    return NoHitLRUScorer(parameters(NoHitLRUParameters, raw))


def default_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register(PrefixCacheScorer.type_name, _simple(PrefixCacheScorer))
    registry.register(QueueScorer.type_name, _simple(QueueScorer))
    registry.register(KVCacheUtilizationScorer.type_name, _simple(KVCacheUtilizationScorer))
    registry.register(InFlightScorer.type_name, _simple(InFlightScorer))
    registry.register(SessionAffinityScorer.type_name, _simple(SessionAffinityScorer))
    registry.register(SessionHashScorer.type_name, _simple(SessionHashScorer))
    registry.register(TTFTCostScorer.type_name, _ttft_cost)
    registry.register(PrecisePrefixCacheScorer.type_name, _precise)
    registry.register(LoadAwareScorer.type_name, _load_aware)
    registry.register(NoHitLRUScorer.type_name, _no_hit_lru)
    registry.register(MaxScorePicker.type_name, _seeded(MaxScorePicker))
    registry.register(RandomPicker.type_name, _seeded(RandomPicker))
    registry.register(RoundRobinPicker.type_name, _simple(RoundRobinPicker))
    registry.register(PREFILL_FILTER, _simple(prefill_filter))
    registry.register(DECODE_FILTER, _simple(decode_filter))
    return registry


def build_profile(
    plugins: list[PluginConfig],
    profile: ProfileConfig,
    registry: PluginRegistry,
    context: PluginContext,
    where: str = "schedulingProfiles[0]",
) -> SchedulingProfile:
    instances: dict[str, Plugin] = {}
    for i, plugin in enumerate(plugins):
        if plugin.ref in instances:
            raise ConfigError(f"plugins[{i}].name: duplicate plugin name {plugin.ref!r}")
        instances[plugin.ref] = registry.create(plugin, context, f"plugins[{i}]")
    picker: Picker | None = None
    scorers: list[WeightedScorer] = []
    filters: list[Filter] = []
    for j, ref in enumerate(profile.plugins):
        at = f"{where}.plugins[{j}]"
        instance = instances.get(ref.plugin_ref)
        if instance is None:
            raise ConfigError(f"{at}.pluginRef: no plugin named {ref.plugin_ref!r}")
        if not isinstance(instance, Scorer | Picker | Filter):
            # A registered factory typed its way past mypy: say so instead of dropping it.
            raise ConfigError(
                f"{at}.pluginRef: plugin {ref.plugin_ref!r} ({type(instance).__name__}) is not "
                "a scorer, filter or picker"
            )
        if isinstance(instance, Scorer):
            weight = 1.0 if ref.weight is None else ref.weight
            scorers.append(WeightedScorer(ref.plugin_ref, instance, weight))
        elif ref.weight is not None:
            raise ConfigError(f"{at}.weight: only scorers take a weight")
        elif isinstance(instance, Picker):
            if picker is not None:
                raise ConfigError(f"{at}.pluginRef: a profile has one picker")
            picker = instance
        else:
            filters.append(instance)
    if picker is None:
        picker = MaxScorePicker(context.rng)
    return SchedulingProfile(profile.name, picker, scorers, filters)
