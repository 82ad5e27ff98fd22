"""The scheduling half of the composition root: plugins and profiles, the scheduler with its
producers and observers, flow control, the router and, with disaggregation, the prefill step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from flow_control.controller import FlowController
from router.config.model import (
    GatewayConfig,
    PluginConfig,
    ProfileConfig,
    Strategy,
    builtin_strategy,
)
from router.core.endpoints import EndpointSnapshot
from router.core.framework import PickObserver, Producer, Scheduler, SchedulingProfile
from router.core.pool import EndpointPool
from router.core.sampling import RateSampler
from router.estimators.answer_cache import AnswerCache
from router.estimators.answer_lengths import AnswerLengths
from router.estimators.calibration import Calibrator
from router.estimators.live_sessions import LiveSessions
from router.estimators.token_density import TokenDensity
from router.index.stores import Candidates, Stores
from router.pool.metrics import GatewayMetrics
from router.precise.routing import PreciseRouter, precise_enabled
from router.precise.runtime import PreciseRuntime
from router.scheduling.disagg import Disaggregator, build_disagg_profiles
from router.scheduling.filters import DECODE_ROLES
from router.scheduling.plugins import PluginContext, PluginRegistry, build_profile
from router.scheduling.producers import AffinityTracker, PrefixTracker
from router.scheduling.routing import (
    FIRST_BYTES_LEARNED_BURST,
    FIRST_BYTES_LEARNED_PER_S,
    Router,
)


@dataclass(frozen=True, slots=True)
class RoutingGraph:
    """The scheduling half of the graph: what the proxy routes with."""

    scheduler: Scheduler
    flow: FlowController
    router: Router
    calibrator: Calibrator
    density: TokenDensity
    answers: AnswerCache
    lengths: AnswerLengths
    precise: PreciseRuntime | None
    prefill_profile: SchedulingProfile | None
    live: LiveSessions


def _plugins(config: GatewayConfig) -> Strategy:
    """The configured plugins and profile (the only one, or the one named decode: llm-d's
    disaggregation turned off leaves both), or the named strategy's."""
    if config.plugins is None:
        return builtin_strategy(config.strategy)
    profiles = config.scheduling_profiles
    assert profiles  # enforced by the config model
    decode = [p for p in profiles if p.name == "decode"]
    return config.plugins, (decode or profiles)[0]


def _build_scheduler(
    config: GatewayConfig,
    plugins: list[PluginConfig],
    profile_cfg: ProfileConfig,
    registry: PluginRegistry,
    context: PluginContext,
    stores: Stores,
    metrics: GatewayMetrics,
    precise: PreciseRuntime | None,
) -> tuple[Scheduler, SchedulingProfile | None, LiveSessions]:
    """The scheduler with its producers and observers, the prefill profile (disaggregated),
    and the live sessions' estimate among the producers."""
    prefill_profile: SchedulingProfile | None = None
    if config.disaggregation.enabled:
        profile, prefill_profile = build_disagg_profiles(
            plugins, config.scheduling_profiles or [profile_cfg], registry, context
        )
    else:
        profiles_cfg = config.scheduling_profiles or [profile_cfg]
        at = next(j for j, p in enumerate(profiles_cfg) if p is profile_cfg)
        where = f"schedulingProfiles[{at}]"
        profile = build_profile(plugins, profile_cfg, registry, context, where)
        for j, other in enumerate(profiles_cfg):
            if j != at:  # never run, but a mistake in it fails now, not when it is turned on
                build_profile(plugins, other, registry, context, f"schedulingProfiles[{j}]")
    prefix = PrefixTracker(stores.index)
    sessions = AffinityTracker(stores.affinity)
    live = LiveSessions(config.session_affinity.max_sessions, registry=metrics.registry)
    producers: list[Producer] = [prefix, sessions, live]
    observers: list[PickObserver] = [prefix, sessions, live]
    if precise is not None:
        producers.append(precise.tracker)
        observers.append(precise.tracker)
    # Scorers that learn from the pick (no-hit-lru-scorer), after the stores have recorded it:
    # the prefill profile's too (its own instances), or they would never learn a prefill pick.
    profiles = [profile] if prefill_profile is None else [profile, prefill_profile]
    observers += [
        ws.scorer for p in profiles for ws in p.scorers if isinstance(ws.scorer, PickObserver)
    ]
    return Scheduler(profile, producers=producers, observers=observers), prefill_profile, live


def _build_flow(
    config: GatewayConfig, candidates: Candidates, registry: CollectorRegistry
) -> FlowController:
    scrape = config.pool.metrics_scrape
    health = config.pool.health_check
    admitted_to = candidates
    if config.disaggregation.enabled:
        # Requests are admitted to the decode pool: an idle prefill endpoint (which short
        # and cached prompts never reach) must not count as room.
        def admitted_to(model: str) -> list[EndpointSnapshot]:
            return [c for c in candidates(model) if c.role in DECODE_ROLES]

    return FlowController(
        config.flow_control,
        admitted_to,
        registry=registry,
        scrape_interval=scrape.interval_seconds,
        scrape_timeout=scrape.timeout_seconds,
        health_cycle=health.interval_seconds + health.timeout_seconds,
    )


def build_routing(
    config: GatewayConfig,
    registry: PluginRegistry,
    pool: EndpointPool,
    stores: Stores,
    metrics: GatewayMetrics,
) -> RoutingGraph:
    calibrator = Calibrator(registry=metrics.registry)
    density = TokenDensity(metrics.registry)
    answers = AnswerCache(metrics.registry)
    lengths = AnswerLengths(metrics.registry)
    plugins, profile_cfg = _plugins(config)
    precise = None
    if precise_enabled(config, plugins):
        precise = PreciseRuntime(config, metrics.registry, stores.redis_metrics)
    context = PluginContext(
        random.Random(config.seed), calibrator, precise.tracker if precise else None
    )
    scheduler, prefill_profile, live = _build_scheduler(
        config, plugins, profile_cfg, registry, context, stores, metrics, precise
    )
    candidates = stores.candidates(pool)
    flow = _build_flow(config, candidates, metrics.registry)
    learning = RateSampler(FIRST_BYTES_LEARNED_PER_S, FIRST_BYTES_LEARNED_BURST)
    router: Router
    if precise is not None:
        router = PreciseRouter(
            config, pool, candidates, scheduler, flow, metrics, tracker=precise.tracker,
            responses=stores.responses, calibrator=calibrator, answers=answers, density=density,
            learning=learning, lengths=lengths,
        )
    else:
        router = Router(
            config, pool, candidates, scheduler, flow, metrics, responses=stores.responses,
            calibrator=calibrator, answers=answers, density=density, learning=learning,
            lengths=lengths,
        )
    return RoutingGraph(
        scheduler, flow, router, calibrator, density, answers, lengths, precise,
        prefill_profile, live,
    )


def build_disagg(
    config: GatewayConfig, routing: RoutingGraph, metrics: GatewayMetrics
) -> Disaggregator | None:
    if routing.prefill_profile is None:
        return None
    pd = config.disaggregation
    timeout = pd.prefill_timeout_seconds or config.proxy.first_byte_timeout_seconds
    return Disaggregator(pd, routing.router, routing.prefill_profile, metrics, timeout)


