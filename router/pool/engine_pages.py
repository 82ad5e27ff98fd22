"""What the gateway reads off a vLLM replica's pages: its ``/metrics`` and its ``/v1/models``.

Only the handful of vLLM series a router needs are parsed, line by line, instead of the whole
exposition: a real vLLM ``/metrics`` page carries hundreds of histogram lines, and a full
parser run ten times a second per endpoint would eat the event loop the proxy needs.
"""

from __future__ import annotations

import math
import re

import orjson

from router.core.endpoints import EngineMetrics

_WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # Deprecated name (vLLM exported both for a while): used only when the current one is absent.
    "vllm:gpu_cache_usage_perc": "kv_usage_deprecated",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    # Their names before vLLM 0.9.2 (exported along with the current ones until 0.11), the
    # releases whose KV use is read from the deprecated name above.
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_deprecated",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_deprecated",
}
# When the engine started, the newest of its label sets (not summed): the prefix-query
# counter's creation time, whose reset tells a restart (either name), else the process's.
_STARTED = ("vllm:prefix_cache_queries_created", "vllm:gpu_prefix_cache_queries_created")
_PROCESS_START = "process_start_time_seconds"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_vllm_metrics(text: str, scraped_at: float) -> EngineMetrics:
    """Sum each wanted series over its label sets (several models, LoRA adapters, the engines
    of a data-parallel server), except KV use, a share: their mean. A value that is not a
    finite number is skipped."""
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    labels_of_config: dict[str, str] = {}
    started = process_start = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            if line.startswith(_PROCESS_START):
                process_start = _value(line[len(_PROCESS_START) :]) or 0.0
            continue
        brace = line.find("{")
        name_end = brace if brace != -1 else line.find(" ")
        name = line[:name_end]
        if name == "vllm:cache_config_info" and brace != -1:
            labels_of_config = dict(_LABEL.findall(line[brace : line.rfind("}") + 1]))
            continue
        field = _WANTED.get(name)
        if field is None and name not in _STARTED:
            continue
        value = _value(line[line.rfind("}") + 1 :] if brace != -1 else line[name_end:])
        if value is None:
            continue
        if field is None:
            started = max(started, value)
            continue
        values[field] = values.get(field, 0.0) + value
        counts[field] = counts.get(field, 0) + 1
    kv_field = _current_or_deprecated(values, "kv_usage")
    kv_usage = values.get(kv_field, 0.0) / max(1, counts.get(kv_field, 0))
    return EngineMetrics(
        waiting=values.get("waiting", 0.0),
        running=values.get("running", 0.0),
        kv_usage=min(1.0, max(0.0, kv_usage)),
        block_size=_int_label(labels_of_config, "block_size"),
        num_gpu_blocks=_int_label(labels_of_config, "num_gpu_blocks"),
        prefix_hits=values.get(_current_or_deprecated(values, "prefix_hits"), 0.0),
        prefix_queries=values.get(_current_or_deprecated(values, "prefix_queries"), 0.0),
        engine_started=started or process_start,
        scraped_at=scraped_at,
    )


def _value(part: str) -> float | None:
    """A sample's value (what follows its name and labels); None: not a finite number."""
    tokens = part.split()
    if not tokens:
        return None
    try:
        value = float(tokens[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _current_or_deprecated(values: dict[str, float], field: str) -> str:
    """The field under its current name if the page has it, else its deprecated one's (never
    both summed: a release exporting both counts the same thing twice)."""
    return field if field in values else f"{field}_deprecated"


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        return int(float(raw))
    except (ValueError, OverflowError):  # not a number, or an infinite one
        return None


def listed_models(body: bytes) -> dict[str, str | None] | None:
    """The models of an OpenAI ``/v1/models`` answer (vLLM's: its served names, and the LoRA
    adapters loaded now, whose ``parent`` names their base model), each with its parent (None:
    a base model); None: not such an answer."""
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    return {
        str(m["id"]): None if m.get("parent") is None else str(m["parent"])
        for m in data
        if isinstance(m, dict) and m.get("id") is not None
    }
