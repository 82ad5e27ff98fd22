"""results.json and results.md of a benchmark (and the plots, when matplotlib is there)."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench.metrics import Summary, TargetResult
from benchmarks.bench.runner import BenchReport


def _num(value: float, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _kilo(value: float) -> str:
    return f"{value / 1000:,.0f}k" if value >= 10_000 else f"{value:,.0f}"


def _s(summary: Summary | None, attr: str, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if summary is None else _num(getattr(summary, attr) * scale, digits)


HEADER = (
    "| target | TTFT p50 s | TTFT p90 s | TTFT p99 s | engine TTFT p50 / p90 s | ITL p50 ms "
    "| ITL p90 ms | E2E p50 s | E2E p90 s | E2E p99 s | input tok/min | output tok/min | cached "
    "| reuse captured | imbalance | errors |"
)


def table_row(r: TargetResult) -> str:
    errors = str(r.errors) + (f" (+{r.incomplete} not run)" if r.incomplete else "")
    cells = [
        r.name,
        _s(r.ttft, "p50"), _s(r.ttft, "p90"), _s(r.ttft, "p99"),
        f"{_num(r.server_ttft_p50)} / {_num(r.server_ttft_p90)}",
        _s(r.itl, "p50", 1000, 1), _s(r.itl, "p90", 1000, 1),
        _s(r.e2e, "p50"), _s(r.e2e, "p90"), _s(r.e2e, "p99"),
        _kilo(r.input_tpm), _kilo(r.output_tpm),
        _pct(r.cached_ratio), _pct(r.captured), _num(r.imbalance), errors,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def misses_table(results: Sequence[TargetResult]) -> list[str]:
    rows = [f"| {r.name} | {cell} |" for r in results if (cell := r.misses.cell()) != "-"]
    if not rows:
        return []
    return [
        "",
        "Reusable tokens missed, in points of the reusable tokens, by where the request went "
        "against its conversation's previous one (benchmarks/bench/misses.py): *placed* (a "
        "conversation's first request), *moved* (a later one sent elsewhere), *at home* (sent "
        "where the previous went, which no longer held it). Client-side (answers' "
        "`cached_tokens`), so it can differ a little from *reuse captured*.",
        "",
        "| target | missed: placed / moved / at home |",
        "|---|---|",
        *rows,
    ]


def markdown(report: BenchReport) -> str:
    s, wl, est = report.settings, report.workload, report.estimate
    ran = [r for r in report.results if r.status == "ok"]
    lines = [
        f"# prefixgate bench: {wl.name}",
        "",
        f"- command: `{s.command}`" if s.command else "- command: (programmatic)",
        f"- {s.replicas} simulated replicas, KV cache {s.num_gpu_blocks} blocks x "
        f"{s.block_size} = {s.num_gpu_blocks * s.block_size:,} tokens each, speed x{s.speed:g}",
        f"- workload: {len(wl.conversations)} conversations, {wl.num_requests} requests, "
        f"concurrency {wl.concurrency}" + (f", rate {wl.rate}/s" if wl.rate else "")
        + f", seed {wl.seed}",
        f"- reusable prompt tokens (one replica, infinite cache): {_pct(est.fraction)} of "
        f"{est.prompt_tokens:,} (estimate); longest prompt {est.max_prompt_tokens:,} tokens",
        "",
        "Latencies are client-side, in simulated seconds (wall x speed); tokens per simulated "
        "minute. *cached*: prefix-cache hits / prompt tokens on the replicas (from /metrics); "
        "*reuse captured*: cached tokens / reusable tokens; *imbalance*: max / mean prefill "
        "work (uncached prompt tokens) per replica; *engine TTFT*: the replicas' own TTFT "
        "histogram (from arrival at the engine, without router and client overhead; "
        "interpolated within vLLM's buckets, so coarse).",
        "",
        HEADER,
        "|" + "---|" * 16,
        *(table_row(r) for r in ran),
    ]
    lines += misses_table(ran)
    notes = [r for r in report.results if r.status != "ok" or r.note]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"- {r.name}: {r.status}" + (f": {r.note}" if r.note else "") for r in notes]
    params = ", ".join(f"{k}={v}" for k, v in wl.params.items())
    lines += ["", f"Workload parameters: {params}", ""]
    return "\n".join(lines)


def to_json(report: BenchReport) -> dict[str, Any]:
    s, est = report.settings, report.estimate
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()}
    settings["peer_dirs"] = [str(p) for p in s.peer_dirs]
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(report.started_at)),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "settings": settings,
        "workload": {
            "name": report.workload.name,
            "conversations": len(report.workload.conversations),
            "requests": report.workload.num_requests,
            "concurrency": report.workload.concurrency,
            "rate": report.workload.rate,
            "params": report.workload.params,
            "estimate": {
                "prompt_tokens": est.prompt_tokens,
                "reusable_tokens": est.reusable_tokens,
                "reusable_fraction": est.fraction,
                "max_prompt_tokens": est.max_prompt_tokens,
            },
        },
        "results": [r.to_json() for r in report.results],
    }


def write(report: BenchReport, out: Path) -> list[Path]:
    """Write results.json, results.md and, if possible, the plots; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(clean_json(to_json(report)), indent=2, allow_nan=False))
    paths[1].write_text(markdown(report))
    if report.settings.plots:
        from benchmarks.bench.plots import write_plots

        paths += write_plots(report.results, out)
    return paths


def clean_json(value: Any) -> Any:
    """NaN (a percentile of nothing) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value
