"""The ``flowControl:`` section of the gateway config.

Every key has a default so that an empty section (or none at all) gives a working controller:
one default band, round-robin fairness, llm-d's saturation thresholds. Models use the
gateway's one :class:`~router.core.strict.Strict` base, so an unknown or invalid key fails at
start-up with a message naming it (``flowControl.priorityBands[0].maxRequests: ...``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.alias_generators import to_snake

from router.core.strict import Strict

FairnessPolicyName = Literal["round-robin", "fcfs", "program-aware"]

MiB = 1024 * 1024
_UTILIZATION_KEYS = {"queue_depth_threshold", "kv_cache_util_threshold", "in_flight_threshold"}


class ProgramAwareConfig(Strict):
    """``program-aware``: least attained service first (flow_control/policies.py).

    A flow's score is ``serviceWeight * (1 - its decayed service, range-normalised over the
    flows waiting)`` plus ``headWaitWeight * (its head request's wait, range-normalised)``;
    the highest goes next. Defaults are llm-d's ``program-aware-fairness``.
    """

    service_weight: float = Field(0.8, ge=0)
    head_wait_weight: float = Field(0.2, ge=0)
    # Attained service halves every this many seconds; 0 never forgets.
    half_life_seconds: float = Field(60.0, ge=0)
    # Programs (fairness ids) remembered; the least recently served are forgotten first.
    max_programs: int = Field(10_000, ge=1)


class BandConfig(Strict):
    """Limits and fairness policy of one priority band."""

    max_requests: int = Field(1000, ge=1)
    # Queued requests hold their bodies; agent prompts are ~1 MB each.
    max_bytes: int = Field(256 * MiB, ge=1)
    fairness_policy: FairnessPolicyName = "round-robin"
    program_aware: ProgramAwareConfig = ProgramAwareConfig()


class PriorityBandConfig(BandConfig):
    priority: int


class ObjectiveConfig(Strict):
    """An inference objective named by the ``x-gateway-inference-objective`` header."""

    name: str = Field(min_length=1)
    priority: int = 0
    # None: the section's defaultRequestTTL.
    ttl_seconds: float | None = Field(None, gt=0)
    # Time-to-first-token target of the objective's requests (x-llm-d-slo-ttft-ms overrides
    # it per request). A sheddable request whose best predicted TTFT misses it is rejected.
    ttft_slo_ms: float | None = Field(None, gt=0)


class SessionBoostConfig(Strict):
    """Raise the priority of a request that continues a recently served session."""

    enabled: bool = False
    window_seconds: float = Field(30.0, gt=0)
    priority_boost: int = Field(1, ge=0)
    max_sessions: int = Field(100_000, ge=1)


class ConcurrencyLimitConfig(Strict):
    """The learned per-endpoint limit on requests waiting for their first byte.

    ``tolerance``: how many times the best first-byte-to-prediction ratio seen may be reached
    before the limit shrinks (the queue a replica may keep before the gateway holds work).
    """

    initial_limit: int = Field(16, ge=1)
    min_limit: int = Field(1, ge=1)
    max_limit: int = Field(256, ge=1)
    tolerance: float = Field(2.0, ge=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> ConcurrencyLimitConfig:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("need minLimit <= initialLimit <= maxLimit")
        return self


class SaturationDetectorConfig(Strict):
    """When the pool counts as saturated (requests then wait in the gateway).

    ``type: concurrency`` (the default): every endpoint is at its learned concurrency limit
    (``concurrencyLimit``). ``type: utilization``: llm-d's thresholds on scraped metrics,
    below; the pool is saturated when every endpoint reaches one.

    ``metricsStalenessThreshold`` is left unset on purpose: it is then derived from the
    gateway's scrape settings (see ``flow_control.saturation.default_staleness`` for why
    llm-d's 200 ms is not safe with a 100 ms scrape interval).
    """

    type: Literal["concurrency", "utilization"] = "concurrency"
    concurrency_limit: ConcurrencyLimitConfig = ConcurrencyLimitConfig()
    # Above 0: every endpoint has at least 0 requests waiting.
    queue_depth_threshold: float = Field(5, gt=0)
    kv_cache_util_threshold: float = Field(0.8, gt=0, le=1)
    # The gateway's own count, the one signal available before a scrape lands. vLLM runs up
    # to max_num_seqs (256 by default) at once; beyond that requests only queue in the engine.
    in_flight_threshold: int = Field(256, ge=1)
    # None: derived from pool.metricsScrape (at least 1 s); set it only to override.
    metrics_staleness_threshold: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _infer_type(cls, data: Any) -> Any:
        """Thresholds without a type mean the utilization detector (llm-d's, and this
        gateway's before the concurrency detector); thresholds with the other type are an
        error rather than silently unused."""
        if not isinstance(data, dict):
            return data
        given = sorted(k for k in data if to_snake(k) in _UTILIZATION_KEYS)
        if not given:
            return data
        if "type" not in data:
            return {**data, "type": "utilization"}
        if data["type"] != "utilization":
            raise ValueError(f"{', '.join(given)} only apply to type: utilization")
        return data


class FlowControlConfig(Strict):
    enabled: bool = True
    priority_bands: list[PriorityBandConfig] = Field(default_factory=list)
    # Requests below every configured band (all of them, when none is configured).
    default_band: BandConfig = BandConfig()
    max_requests: int = Field(5000, ge=1)
    max_bytes: int = Field(1024 * MiB, ge=1)
    default_request_ttl: float = Field(60.0, gt=0, alias="defaultRequestTTL")
    objectives: list[ObjectiveConfig] = Field(default_factory=list)
    session_boost: SessionBoostConfig = SessionBoostConfig()
    saturation_detector: SaturationDetectorConfig = SaturationDetectorConfig()
    retry_after_seconds: float = Field(1.0, gt=0)
    # Metrics move between releases, so queued work is retried on this tick.
    dispatch_interval_seconds: float = Field(0.02, gt=0, le=5)

    @field_validator("priority_bands")
    @classmethod
    def _unique_bands(cls, value: list[PriorityBandConfig]) -> list[PriorityBandConfig]:
        seen = [b.priority for b in value]
        dupes = sorted({p for p in seen if seen.count(p) > 1})
        if dupes:
            raise ValueError(f"duplicate band priorities: {dupes}")
        return value

    @field_validator("objectives")
    @classmethod
    def _unique_objectives(cls, value: list[ObjectiveConfig]) -> list[ObjectiveConfig]:
        names = [o.name for o in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate objective names: {', '.join(dupes)}")
        return value
