"""Where a run's slow first tokens come from: each target's TTFT tail, by kind of request.

    python -m benchmarks.ttft_tail OUT [--threshold S]

reads the per-request lines ``prefixgate bench`` writes (``OUT/logs/<target>.requests.jsonl``)
and prints, for each target, how many requests of each class had a TTFT above one threshold
common to all targets, with the class's mean TTFT and mean uncached prompt tokens. By default
the threshold is the lowest TTFT p90 among the targets: the counts then say which requests
hold a target's p90 above the best one, and the means what that target paid for them (a
router that moves a few sub-agents of a large group off their parent's replica puts fewer of
that group above the line, and those it moved far above it).

Classes come from the workload's script, not from the routing: a main conversation's first
turn (a new context) and its later turns, a sub-agent group's first turns by the group's size
(siblings launched together from one parent context), and the sub-agents' later turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench.metrics import percentile

# Upper bounds of the group-size buckets a sub-agent burst's first turns are counted in.
_GROUP_BUCKETS = ((3, "2-3"), (5, "4-5"), (8, "6-8"))


def request_class(record: Mapping[str, Any]) -> str:
    """The class of one request line (lines written before ``group``/``turn`` existed get
    their kind only)."""
    kind = str(record.get("kind", "main"))
    if "turn" not in record:
        return kind
    first = record["turn"] == 0
    if kind != "subagent":
        return f"{kind}: first turn" if first else f"{kind}: later turns"
    if not first:
        return "subagent: later turns"
    size = int(record.get("group") or 0)
    label = next((name for bound, name in _GROUP_BUCKETS if size <= bound), "9+")
    return f"subagent group of {label}: first turn"


@dataclass(frozen=True, slots=True)
class ClassTail:
    name: str
    requests: int
    above: int
    mean_ttft_s: float
    mean_uncached: float


@dataclass(frozen=True, slots=True)
class TargetTail:
    target: str
    requests: int
    mean_ttft_s: float
    p90_s: float
    classes: tuple[ClassTail, ...]

    @property
    def above(self) -> int:
        return sum(c.above for c in self.classes)


def _answered(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("ok") and r.get("ttft") is not None]


def tail_of(target: str, records: Sequence[Mapping[str, Any]], threshold_s: float) -> TargetTail:
    """One target's requests above ``threshold_s``, class by class (classes sorted by name)."""
    answered = _answered(records)
    by_class: dict[str, list[Mapping[str, Any]]] = {}
    for r in answered:
        by_class.setdefault(request_class(r), []).append(r)
    classes = tuple(
        ClassTail(
            name,
            len(rows),
            sum(1 for r in rows if r["ttft"] > threshold_s),
            statistics.fmean(r["ttft"] for r in rows),
            statistics.fmean(
                max(0, int(r.get("prompt_tokens", 0)) - int(r.get("cached_tokens", 0)))
                for r in rows
            ),
        )
        for name, rows in sorted(by_class.items())
    )
    ttfts = [float(r["ttft"]) for r in answered]
    mean = statistics.fmean(ttfts) if ttfts else float("nan")
    return TargetTail(target, len(answered), mean, percentile(ttfts, 90), classes)


def p90_of(records: Sequence[Mapping[str, Any]]) -> float:
    return percentile([float(r["ttft"]) for r in _answered(records)], 90)


def load_runs(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Each target's request lines, in the order of the run's results when it has them."""
    logs = out / "logs"
    files = {p.name.removesuffix(".requests.jsonl"): p for p in logs.glob("*.requests.jsonl")}
    order = sorted(files)
    results = out / "results.json"
    if results.exists():
        ran = [r["name"] for r in json.loads(results.read_text()).get("results", [])]
        order = [n for n in ran if n in files] + [n for n in order if n not in ran]
    return {
        name: [json.loads(line) for line in files[name].read_text().splitlines() if line]
        for name in order
    }


def markdown(tails: Sequence[TargetTail], threshold_s: float) -> str:
    lines = [f"TTFT above {threshold_s:.3f} s (simulated seconds), by request class:", ""]
    for t in tails:
        lines += [
            f"#### {t.target}: {t.above} of {t.requests} above; TTFT mean {t.mean_ttft_s:.3f} s, "
            f"p90 {t.p90_s:.3f} s",
            "",
            "| class | requests | above | mean TTFT s | mean uncached tokens |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.name} | {c.requests} | {c.above} | {c.mean_ttft_s:.3f} | {c.mean_uncached:.0f} |"
            for c in t.classes
        ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a prefixgate bench --out folder")
    parser.add_argument(
        "--threshold", type=float, help="seconds (default: the lowest TTFT p90 of the targets)"
    )
    args = parser.parse_args(argv)
    runs = {name: rows for name, rows in load_runs(args.out).items() if _answered(rows)}
    if not runs:
        parser.error(f"no answered requests under {args.out / 'logs'}")
    threshold = args.threshold
    if threshold is None:
        threshold = min(p90_of(rows) for rows in runs.values())
    print(markdown([tail_of(name, rows, threshold) for name, rows in runs.items()], threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
