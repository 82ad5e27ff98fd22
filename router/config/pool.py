"""The endpoint pool's configuration: its endpoints, and how the gateway watches them (health
checks, metrics scrapes, passive outlier detection)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from router.core.endpoints import endpoint_id_from_url
from router.core.strict import Strict


class EndpointConfig(Strict):
    url: str
    role: Literal["both", "prefill", "decode"] = "both"
    models: list[str] = Field(default_factory=list)
    # The upstream's own key (vLLM --api-key), sent instead of the client's; overrides pool's.
    api_key: SecretStr | None = None
    api_key_env: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        endpoint_id_from_url(value)
        return value.rstrip("/")


class HealthCheckConfig(Strict):
    interval_seconds: float = Field(2.0, gt=0)
    timeout_seconds: float = Field(1.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)


class MetricsScrapeConfig(Strict):
    interval_seconds: float = Field(0.1, gt=0, le=60)
    timeout_seconds: float = Field(0.5, gt=0)


class SpeedProbeConfig(Strict):
    """A few one-token completions timed on each endpoint as it comes up: the speed prior of
    the cost model, before traffic shows which replicas are slow (docs/routing.md)."""

    enabled: bool = True
    requests: int = Field(3, ge=1, le=10)
    prompt_bytes: int = Field(256, ge=16, le=65536)
    timeout_seconds: float = Field(2.0, gt=0)
    # How long start-up waits for the first probes (the gateway is not ready meanwhile).
    startup_wait_seconds: float = Field(3.0, ge=0, le=60)


class OutlierDetectionConfig(Strict):
    """Passive health: eject an endpoint after consecutive connect errors, timeouts or 5xx."""

    enabled: bool = True
    consecutive_failures: int = Field(5, ge=1)
    base_ejection_seconds: float = Field(30.0, gt=0)
    max_ejection_seconds: float = Field(300.0, gt=0)
    max_ejection_percent: float = Field(50.0, ge=0, le=100)

    @model_validator(mode="after")
    def _ejection_bounds(self) -> OutlierDetectionConfig:
        # Ejections grow from the base up to the max: a max below the base contradicts it.
        if self.max_ejection_seconds < self.base_ejection_seconds:
            raise ValueError("maxEjectionSeconds: must not be less than baseEjectionSeconds")
        return self


class PoolConfig(Strict):
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    health_check: HealthCheckConfig = HealthCheckConfig()
    metrics_scrape: MetricsScrapeConfig = MetricsScrapeConfig()
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    speed_probe: SpeedProbeConfig = SpeedProbeConfig()
    api_key: SecretStr | None = None
    api_key_env: str | None = None

    @field_validator("endpoints")
    @classmethod
    def _unique(cls, value: list[EndpointConfig]) -> list[EndpointConfig]:
        ids = [endpoint_id_from_url(e.url) for e in value]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate endpoints: {', '.join(dupes)}")
        return value
