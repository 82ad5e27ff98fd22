"""Configuration of precise prefix routing (``precisePrefix:`` in the gateway YAML).

Kept apart from router/config/model.py so that the models stay next to the feature.

Example::

    strategy: precise
    precisePrefix:
      blockSize: 16                      # the engines' --block-size
      baseModels: [qwen]                 # every base model's served names; others are adapters
      tokenizer: {type: huggingface, path: /models/qwen/tokenizer.json}
      kvEvents:
        port: 5557                       # every replica publishes on host:5557 ...
        # portOffset: -2543              # ... or on its HTTP port + offset ...
        endpoints:                       # ... or per endpoint, by id (host:port)
          "10.0.0.7:8000": {address: "tcp://10.0.0.7:5557"}
      index:                             # where the index lives: memory (default) or redis,
        backend: redis                   # shared by every gateway replica
        url: redis://redis:6379/0
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from router.core.strict import Strict, check_redis_url


class TokenizerConfig(Strict):
    # remote: the replica's /tokenize (no setup; one round trip per new prompt);
    # huggingface: a local tokenizer.json + chat template; sim: the simulator's tokenizer.
    type: Literal["remote", "huggingface", "sim"] = "remote"
    path: str | None = None
    chat_template: str | None = None
    add_special_tokens: bool = True
    timeout_ms: float = Field(250.0, gt=0)
    cache_entries: int = Field(1024, ge=1)
    thread_above_bytes: int = Field(16_384, ge=0)

    @model_validator(mode="after")
    def _path(self) -> TokenizerConfig:
        if self.type == "huggingface" and not self.path:
            raise ValueError("path: a huggingface tokenizer needs the path of its tokenizer.json")
        return self


class KVEventsEndpointConfig(Strict):
    address: str
    replay_address: str | None = None


class KVEventsConfig(Strict):
    port: int | None = Field(None, ge=1, le=65535)
    port_offset: int | None = None
    replay_port: int | None = Field(None, ge=1, le=65535)
    replay_port_offset: int | None = None
    endpoints: dict[str, KVEventsEndpointConfig] = Field(default_factory=dict)
    topic: str = ""
    silence_seconds: float = Field(3.0, gt=0)
    resync_seconds: float = Field(30.0, ge=0)
    replay_timeout_seconds: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _one_rule(self) -> KVEventsConfig:
        if self.port is not None and self.port_offset is not None:
            raise ValueError("port: give port or portOffset, not both")
        if self.replay_port is not None and self.replay_port_offset is not None:
            raise ValueError("replayPort: give replayPort or replayPortOffset, not both")
        return self


class PreciseIndexConfig(Strict):
    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None
    namespace: str = "prefixgate"
    timeout_ms: float = Field(5.0, gt=0)
    # The url is a node of a Redis Cluster.
    cluster: bool = False

    @model_validator(mode="after")
    def _redis(self) -> PreciseIndexConfig:
        check_redis_url(self.url, self.backend, self.cluster)
        if not self.namespace or any(c in self.namespace for c in "{} "):
            raise ValueError("namespace: must be non-empty, without braces or spaces")
        return self


class PrecisePrefixConfig(Strict):
    # None: on when the strategy or a plugin uses precise-prefix-cache-scorer.
    enabled: bool | None = None
    block_size: int = Field(16, ge=1, le=4096)
    speculative_ttl_seconds: float = Field(2.0, ge=0)
    max_blocks_per_endpoint: int = Field(1 << 20, ge=1)
    max_blocks_per_request: int = Field(32_768, ge=1)
    # The names every engine serves its base model under (vLLM --served-model-name), of every
    # base model the gateway routes: a request for any other model names a LoRA adapter, whose
    # blocks are keyed apart (a base model left out would never match its own blocks). Empty:
    # adapters are the names the KV events have shown (lora_name), the rest are base models.
    base_models: list[str] = Field(default_factory=list)
    tokenizer: TokenizerConfig = TokenizerConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    index: PreciseIndexConfig = PreciseIndexConfig()
