"""Knobs of one benchmark run (everything but the workload and the targets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchSettings:
    out: Path
    replicas: int = 8
    speed: float = 5.0
    num_gpu_blocks: int = 2048
    block_size: int = 16
    # The simulator's tokenizer density (characters a token); None: its word-based default.
    bytes_per_token: float | None = None
    max_num_seqs: int = 256
    # Further `prefixgate sim` flags, e.g. ["--prefill-ms-per-token", "0.3"].
    sim_args: list[str] = field(default_factory=list)
    # Per-replica flags after ``sim_args`` (a slow replica's latencies, say): empty, or one
    # list per replica. Consecutive replicas with equal flags share one simulator process.
    replica_sim_args: list[list[str]] = field(default_factory=list)
    # Wall-clock bound of each target's run; requests still open then are cut and counted.
    deadline_s: float = 600.0
    peer_dirs: list[Path] = field(default_factory=list)
    redis_url: str | None = None
    base_port: int | None = None
    model: str = "sim-model"
    plots: bool = True
    progress: bool = True
    # prefixgate gateways' log level ("debug" logs every routing decision with its terms).
    gateway_log_level: str = "warning"
    # Simulated seconds after a target is ready before the workload starts (first scrapes).
    settle_s: float = 0.5
    command: str = ""
    # Set by the runner when a target routes on KV events: replica HTTP port + offset = its
    # events PUB port (and + replay offset, its replay port).
    kv_events_offset: int | None = None
    kv_replay_offset: int | None = None
