"""Gateway configuration: strict, typed, loaded from YAML in the spirit of llm-d's
``EndpointPickerConfig``. Unknown keys and bad values fail at start-up with a message that
names the offending key (``pool.endpoints[0].url: ...``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from flow_control.config import FlowControlConfig
from router.config.llmd import is_llmd
from router.config.llmd import translate as translate_llmd
from router.config.pool import PoolConfig
from router.config.precise import PrecisePrefixConfig
from router.config.strategies import STRATEGIES
from router.core.errors import ConfigError
from router.core.hashing import DEFAULT_BLOCK_BYTES
from router.core.strict import Strict, check_redis_url

_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")


class PrefixIndexConfig(Strict):
    # replicated: each process's own index and affinity, writes replicated through the Redis at
    # url (router/index/replicated.py); in-flight counts and response routes are in that Redis.
    backend: Literal["memory", "redis", "replicated"] = "memory"
    block_bytes: int = Field(DEFAULT_BLOCK_BYTES, ge=16, le=65536)
    max_blocks_per_request: int = Field(32768, ge=1)
    # None: derived per endpoint from its reported KV capacity (vllm:cache_config_info).
    capacity_blocks: int | None = Field(None, ge=1)
    url: str | None = None
    namespace: str = "prefixgate"
    timeout_ms: float = Field(5.0, gt=0)
    # Redis: the most blocks one update script touches; a longer cold chain goes in pieces, one
    # round trip each, so no script holds the server long. 0: always one round trip.
    max_blocks_per_write: int = Field(256, ge=0)
    # The url is a node of a Redis Cluster (the client learns the others from it). Every store
    # built from this url (index, session affinity, in-flight counts, response routes) uses it.
    cluster: bool = False

    @model_validator(mode="after")
    def _redis_url(self) -> PrefixIndexConfig:
        check_redis_url(self.url, self.backend, self.cluster)
        # Every Redis key tag is built from it (router/index/redis_link.py).
        if not self.namespace or any(c in self.namespace for c in "{} "):
            raise ValueError("namespace: must be non-empty, without braces or spaces")
        if self.backend == "replicated" and self.cluster:
            raise ValueError("cluster: the replicated backend publishes on one Redis server")
        return self


class SessionAffinityConfig(Strict):
    ttl_seconds: float = Field(600.0, gt=0)
    max_sessions: int = Field(100_000, ge=1)
    # Session headers read after x-session-id and before the coding agents' own
    # (router/protocol/agent_identity.py); agentHeaders: false reads only x-session-id and these.
    headers: list[str] = Field(default_factory=list, max_length=16)
    agent_headers: bool = True

    @field_validator("headers")
    @classmethod
    def _header_names(cls, value: list[str]) -> list[str]:
        bad = [h for h in value if not _HEADER_NAME.fullmatch(h)]
        if bad:
            raise ValueError(f"not an HTTP header name: {', '.join(map(repr, bad))}")
        return [h.lower() for h in value]


class ResponsesConfig(Strict):
    """Memory of which endpoint stored each Responses API response
    (router/index/response_store.py).
    """

    # vLLM keeps stored responses until it restarts; a day covers an agent's session.
    ttl_seconds: float = Field(86400.0, gt=0)
    max_entries: int = Field(100_000, ge=1)
    # Reads with the Redis backend: a miss costs a probe of every endpoint, so more than the
    # prefix index's budget is worth waiting.
    redis_timeout_ms: float = Field(50.0, gt=0)
    # Asking the endpoints for an id the gateway has no record of (0: never ask).
    probe_timeout_seconds: float = Field(2.0, ge=0)


class ServerConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # 200K-token agent prompts are ~1 MB of text; JSON escaping and images need headroom.
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # Bodies at least this big are parsed, rendered and hashed off the event loop, so that one
    # huge prompt does not stall every other request.
    offload_body_bytes: int = Field(1024 * 1024, ge=0)
    # Processes doing that parsing (started on the first such body): orjson holds the GIL for
    # a whole decode, so a thread would stall the loop too. 0: a worker thread after all.
    offload_processes: int = Field(1, ge=0, le=16)
    # A client that sends its body slower than this is answered 408, not waited for forever.
    body_timeout_seconds: float = Field(60.0, gt=0)
    # SIGTERM: /ready turns 503 at once, new connections are still taken for the delay (load
    # balancers take a moment to notice), then refused while in-flight requests drain.
    shutdown_delay_seconds: float = Field(0.0, ge=0)
    drain_timeout_seconds: float = Field(30.0, ge=0)
    # An idle client connection is closed after this; set it above the idle timeout of any load
    # balancer in front, or it reuses a connection the gateway is closing (a 502 or a reset).
    keep_alive_seconds: float = Field(30.0, ge=1, le=3600)
    access_log: bool = True
    # Share of successful requests that get an access line (failures always do).
    access_log_sample_rate: float = Field(1.0, gt=0, le=1)
    log_format: Literal["text", "json"] = "text"
    # Answer "x-prefixgate-explain: 1" with the routing decision in "x-prefixgate-decision"
    # (scores and cost terms of the best endpoints). Off by default: it shows fleet internals.
    explain_header: bool = False
    # Processes serving the port (``prefixgate serve``; router/serve/supervisor.py). Above 1 they
    # share
    # the prefix index, session affinity and in-flight counts through prefixIndex's Redis.
    workers: int = Field(1, ge=1, le=64)


class ProxyConfig(Strict):
    connect_timeout_seconds: float = Field(2.0, gt=0)
    # A long prompt can queue and prefill for minutes on a loaded replica.
    first_byte_timeout_seconds: float = Field(600.0, gt=0)
    idle_timeout_seconds: float = Field(300.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=10)
    # Requests in flight to each endpoint (more wait for one to end).
    max_connections: int = Field(1024, ge=1)


class ApiKeyConfig(Strict):
    """One client key (literal, or read from an environment variable) and its tenant."""

    tenant: str = Field(min_length=1, max_length=256)
    key: SecretStr | None = None
    key_env: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("give key or keyEnv (exactly one)")
        return self


class AuthConfig(Strict):
    enabled: bool = False
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    # An environment variable holding "tenant=key,tenant=key".
    api_keys_env: str | None = None
    # Send the client's Authorization / x-api-key on to the endpoints (off: stripped).
    forward_client_key: bool = False


class PluginConfig(Strict):
    type: str
    name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def ref(self) -> str:
        return self.name or self.type


class PluginRef(Strict):
    plugin_ref: str
    # Finite: an infinite weight times a zero score is NaN.
    weight: float | None = Field(None, ge=0, allow_inf_nan=False)


class ProfileConfig(Strict):
    name: str
    plugins: list[PluginRef]


class ExtProcConfig(Strict):
    """``prefixgate epp``: the Envoy ext_proc endpoint picker (GIE's ports by default)."""

    host: str = "127.0.0.1"
    port: int = Field(9002, ge=0, le=65535)
    health_port: int = Field(9003, ge=0, le=65535)
    metrics_port: int = Field(9090, ge=0, le=65535)
    # Endpoints after the pick in x-gateway-destination-endpoint, for Envoy to fall back to.
    fallback_endpoints: int = Field(0, ge=0, le=7)
    # Used when Envoy does not announce its body mode (protocol_config, Envoy < 1.33).
    default_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = "FULL_DUPLEX_STREAMED"
    # Body chunks streamed back to Envoy stay well under gRPC's 4 MiB default message limit.
    body_chunk_bytes: int = Field(62_000, ge=1024, le=4 * 1024 * 1024 - 1024)
    # At SIGTERM: health turns NOT_SERVING, new streams are still taken for the drain (Envoy
    # and the kubelet see the health change), then open streams (answers still being relayed)
    # get the grace. Their sum, with the pod's preStop, must fit its termination grace period.
    shutdown_drain_seconds: float = Field(5.0, ge=0)
    shutdown_grace_seconds: float = Field(45.0, ge=0)


class DiscoveryConfig(Strict):
    """Endpoints from Kubernetes: the pods of an InferencePool, or of a label selector."""

    inference_pool: str | None = None
    label_selector: dict[str, str] | None = None
    # With labelSelector only; an InferencePool carries its own targetPorts.
    target_ports: list[int] = Field(default_factory=list, max_length=8)
    # None: the namespace of the service account (in-cluster), else "default".
    namespace: str | None = None
    # None: in-cluster (KUBERNETES_SERVICE_HOST/PORT, the service account token and CA).
    api_server: str | None = None
    token_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    scheme: Literal["http", "https"] = "http"
    role_label: str = "llm-d.ai/role"
    # Models every discovered endpoint serves; empty: learned from each one's /v1/models.
    models: list[str] = Field(default_factory=list)
    watch_timeout_seconds: int = Field(300, ge=1)
    retry_seconds: float = Field(1.0, gt=0)
    initial_sync_timeout_seconds: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _source(self) -> DiscoveryConfig:
        if (self.inference_pool is None) == (self.label_selector is None):
            raise ValueError("give inferencePool or labelSelector (exactly one)")
        if self.label_selector is not None and not self.target_ports:
            raise ValueError("targetPorts: needed with labelSelector")
        if self.inference_pool is not None and self.target_ports:
            raise ValueError("targetPorts: an InferencePool names its own")
        if any(not 1 <= p <= 65535 for p in self.target_ports):
            raise ValueError("targetPorts: ports are 1..65535")
        return self


class DisaggregationConfig(Strict):
    """Prefill/decode disaggregation (router/scheduling/disagg.py, which justifies the
    threshold).
    """

    enabled: bool = False
    # Prefill goes to the prefill pool from this many uncached prompt tokens on the decode pick.
    non_cached_tokens: int = Field(1024, ge=0)
    # two-step: the gateway runs prefill, then decode; sidecar: x-prefiller-host-port only.
    mode: Literal["two-step", "sidecar"] = "two-step"
    # Queue plus prefill on the prefill endpoint; None: proxy.firstByteTimeoutSeconds.
    prefill_timeout_seconds: float | None = Field(None, gt=0)


class CompatibilityConfig(Strict):
    """Written by the llm-d translation (router/config/llmd.py), not by hand: where the config
    came from, and what it said that prefixgate accepted but ignored (logged at start-up)."""

    source: str
    ignored: list[str] = Field(default_factory=list)


class GatewayConfig(Strict):
    api_version: str = "prefixgate.dev/v1alpha1"
    kind: Literal["EndpointPickerConfig", "GatewayConfig"] = "EndpointPickerConfig"
    server: ServerConfig = ServerConfig()
    pool: PoolConfig = PoolConfig()
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()
    precise_prefix: PrecisePrefixConfig = PrecisePrefixConfig()
    session_affinity: SessionAffinityConfig = SessionAffinityConfig()
    responses: ResponsesConfig = ResponsesConfig()
    proxy: ProxyConfig = ProxyConfig()
    # Off unless the config has a flowControl section (enabled: true by default inside it):
    # holding requests in the gateway only pays where there is an order to keep (priorities,
    # tenants), and costs latency elsewhere (docs/benchmarks/sweep.md).
    flow_control: FlowControlConfig = FlowControlConfig(enabled=False)
    auth: AuthConfig = AuthConfig()
    ext_proc: ExtProcConfig = ExtProcConfig()
    discovery: DiscoveryConfig | None = None
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    # A built-in strategy (router.config.strategies), or explicit plugins + schedulingProfiles.
    strategy: str = "default"
    plugins: list[PluginConfig] | None = None
    scheduling_profiles: list[ProfileConfig] | None = None
    seed: int | None = None
    compatibility: CompatibilityConfig | None = None

    @model_validator(mode="after")
    def _profiles(self) -> GatewayConfig:
        if (self.plugins is None) != (self.scheduling_profiles is None):
            raise ValueError("plugins and schedulingProfiles go together: give both or neither")
        if self.scheduling_profiles is not None and not self.scheduling_profiles:
            raise ValueError("schedulingProfiles: at least one profile is needed")
        if self.plugins is not None and "strategy" in self.model_fields_set:
            raise ValueError("strategy: give a strategy or plugins, not both")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: unknown {self.strategy!r} (known: {sorted(STRATEGIES)})")
        profiles = self.scheduling_profiles
        names = [p.name for p in profiles] if profiles is not None else []
        if self.disaggregation.enabled and profiles is not None:
            missing = {"prefill", "decode"} - set(names)
            extra = set(names) - {"prefill", "decode"}
            if missing or extra:
                raise ValueError(
                    "schedulingProfiles: disaggregation needs profiles named prefill and decode "
                    f"and no other (missing: {', '.join(sorted(missing)) or 'none'}; "
                    f"others: {', '.join(sorted(extra)) or 'none'})"
                )
        elif len(names) > 1 and "decode" not in names:
            # Taking the first would route everything by it (a prefill pool's, say).
            raise ValueError(
                f"schedulingProfiles: {len(names)} profiles ({', '.join(names)}), but without "
                "disaggregation.enabled one schedules every request: give one, or name the one "
                "to use decode"
            )
        return self


# A section's own check says which of its keys is wrong by starting with it ("url: ...").
_KEY_FIRST = re.compile(r"([a-z][A-Za-z0-9]*): (.*)", re.S)


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for item in error.errors():
        path = prefix
        for part in item["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "value_error":
            message = message.removeprefix("Value error, ")
            # The key a section's check names joins the path: pool.x.url, not pool.x: url.
            named = _KEY_FIRST.fullmatch(message)
            if named and (not item["loc"] or item["loc"][-1] != named[1]):
                path = f"{path}.{named[1]}" if path else named[1]
                message = named[2]
        lines.append(f"{path or '<root>'}: {message}")
    return "; ".join(lines)


def parse_config(data: Any) -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config: the top level must be a mapping")
    if is_llmd(data):
        data = translate_llmd(data)
    try:
        # Strict types: YAML already gives bools and numbers their types, so a quoted "no"
        # or "8080", or a bool where a number goes, is a mistake to report, not to convert.
        # Keys by their documented camelCase only (Python code builds models by field name).
        return GatewayConfig.model_validate(data, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise ConfigError(f"invalid config: {format_validation_error(exc)}") from exc


def load_config(path: str | Path) -> GatewayConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    return parse_config(data)


Strategy = tuple[list[PluginConfig], ProfileConfig]


def builtin_strategy(name: str) -> Strategy:
    """The plugins and profile of a built-in strategy (router/config/strategies.py)."""
    try:
        spec = STRATEGIES[name]
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown strategy {name!r} (known: {known})") from None
    plugins = [PluginConfig(type=t, parameters=spec.parameters.get(t, {})) for t in spec.weights]
    plugins.append(PluginConfig(type=spec.picker))
    refs = [PluginRef(plugin_ref=t, weight=w) for t, w in spec.weights.items()]
    refs.append(PluginRef(plugin_ref=spec.picker))
    return plugins, ProfileConfig(name="default", plugins=refs)
