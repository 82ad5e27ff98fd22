"""Configuration of one simulated vLLM replica."""

from __future__ import annotations

from dataclasses import dataclass

# Defaults follow vLLM's own (block size, seqs, batched tokens) and llm-d-inference-sim's
# 8B-on-H100 latency profile.
DEFAULT_MODEL = "sim-model"
PREFILL_MODES = ("batched", "independent", "serial")


@dataclass(frozen=True)
class SimConfig:
    """Every knob of a simulated replica; one instance can be shared by many replicas."""

    model: str = DEFAULT_MODEL
    served_model_names: tuple[str, ...] = ()
    block_size: int = 16
    num_gpu_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144
    itl_ms: float = 12.0
    prefill_overhead_ms: float = 30.0
    prefill_ms_per_token: float = 0.2
    time_factor_under_load: float = 2.0
    # "batched": prefills share the engine's steps and queue behind one another (vLLM).
    # "independent": llm-d-inference-sim's model, each prefill takes overhead + per-token time
    # on its own, scaled by the load factor, however many run at once.
    # "serial": as batched, but one request prefills at a time (an engine without chunked
    # prefill batching: the next prompt waits for the current one to finish prefilling).
    prefill_mode: str = "batched"
    kv_transfer_ms_per_token: float = 0.02
    speed: float = 1.0
    zero_latency: bool = False
    default_max_tokens: int = 64
    seed: int = 0
    log_level: str = "warning"
    # KV events (ZMQ PUB) as vLLM's --kv-events-config: None = off, 0 = an ephemeral port.
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_encoding: str = "array"
    # Tokenizer density, characters of text per token (None: the word-based default, ~4).
    bytes_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 1:
            raise ValueError("block_size and num_gpu_blocks must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}")
        if self.bytes_per_token is not None and not 1.0 <= self.bytes_per_token <= 32.0:
            raise ValueError("bytes_per_token must be in [1, 32]")
        if self.kv_events_encoding not in ("array", "map"):
            raise ValueError("kv_events_encoding must be 'array' or 'map'")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names the server answers to: the model first, then aliases (as vLLM lists them)."""
        if self.served_model_names:
            return self.served_model_names
        return (self.model,)
