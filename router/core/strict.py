"""The one base of every config model: unknown keys and non-finite numbers fail, values are
not coerced from another type, camelCase keys, frozen values.

It lives in core so that every section's models (the gateway's, flow control's, precise
routing's, the scorers' parameters) can share it without importing each other.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Strict(BaseModel):
    # Non-finite numbers fail too: a bound like ``ge=0`` lets an infinite timeout or weight
    # through, and an infinite weight times a zero score is NaN. Strict types, for every model
    # (plugin parameters too, which no section's validation reaches): YAML already gives bools
    # and numbers their types, so a quoted "2" or "no", or a bool for a number, is a mistake to
    # report, not to convert. An int still fills a float.
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        allow_inf_nan=False,
        strict=True,
    )


def check_redis_url(url: str | None, backend: str, cluster: bool) -> None:
    """Config validation of a Redis-backed store's ``url`` and ``cluster`` (ValueError)."""
    if backend in ("redis", "replicated") and not url:
        raise ValueError(f"url: the {backend} backend needs url: redis://host:port/db")
    if url is None:
        return
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("url: must be redis://, rediss:// or unix://")
    if cluster and url.startswith("unix://"):
        raise ValueError("cluster: a Redis Cluster is reached at redis:// or rediss:// addresses")
    if cluster and urlsplit(url).path.strip("/") not in ("", "0"):
        raise ValueError("url: a Redis Cluster has database 0 only")
