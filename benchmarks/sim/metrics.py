"""Prometheus metrics of one replica, named and labelled as vLLM exports them.

Each replica has its own ``CollectorRegistry`` (never the process-global one), so many
replicas can live in one process. Gauges and counters are read from the engine at scrape
time by a custom collector; latency histograms are observed by the engine as requests
progress, in simulated seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket choices.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Gauges and counters computed from the engine's state when scraped."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name
        self._started = time.time()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, cfg = self._engine, self._engine.config
        yield self._gauge(
            "vllm:num_requests_running", "Requests in the running batch.", len(engine.running)
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(engine.waiting)
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", engine.kv.usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", engine.kv.queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", engine.kv.hits
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative preemptions.", engine.stats.preemptions
        )
        yield self._counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", engine.stats.prompt_tokens
        )
        yield self._counter(
            "vllm:generation_tokens", "Generation tokens processed.", engine.stats.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        success.add_metric([self._model, "length"], engine.stats.requests_succeeded)
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the cache config.",
            labels=[
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "cache_dtype",
                "model_name",
            ],
        )
        info.add_metric(
            [str(cfg.block_size), str(cfg.num_gpu_blocks), "True", "auto", self._model], 1.0
        )
        yield info
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], self._started)
        yield lora


class SimMetrics:
    """The registry of one replica plus the latency histograms the engine feeds."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        )
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency.",
            labels,
            registry=self.registry,
            buckets=ITL_BUCKETS,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            registry=self.registry,
            buckets=REQUEST_BUCKETS,
        )
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting.",
            labels,
            registry=self.registry,
            buckets=REQUEST_BUCKETS,
        )
        self._ttft_child = self._ttft.labels(model_name)
        self._itl_child = self._itl.labels(model_name)
        self._e2e_child = self._e2e.labels(model_name)
        self._queue_child = self._queue.labels(model_name)

    def attach(self, engine: Engine) -> None:
        """Expose ``engine``'s gauges and counters in this registry."""
        self.registry.register(_EngineCollector(engine, self.model_name))

    def on_queued(self, seconds: float) -> None:
        self._queue_child.observe(seconds)

    def on_first_token(self, seconds: float) -> None:
        self._ttft_child.observe(seconds)

    def on_token(self, seconds: float) -> None:
        self._itl_child.observe(seconds)

    def on_finished(self, seconds: float) -> None:
        self._e2e_child.observe(seconds)

    def render(self) -> bytes:
        """The text exposition of every metric of this replica."""
        return generate_latest(self.registry)
