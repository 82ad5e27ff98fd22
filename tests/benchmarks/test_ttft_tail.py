"""The TTFT tail by request class, over request lines as ``prefixgate bench`` writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import ttft_tail


def _line(kind: str, group: int, turn: int, ttft: float | None, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": kind, "group": group, "turn": turn, "ok": ttft is not None, "ttft": ttft,
        "prompt_tokens": 1000, "cached_tokens": 900,
    }  # fmt: skip
    row.update(kw)
    return row


def test_classes_come_from_the_script() -> None:
    c = ttft_tail.request_class
    assert c(_line("main", 0, 0, 0.1)) == "main: first turn"
    assert c(_line("main", 0, 3, 0.1)) == "main: later turns"
    assert c(_line("subagent", 2, 0, 0.1)) == "subagent group of 2-3: first turn"
    assert c(_line("subagent", 5, 0, 0.1)) == "subagent group of 4-5: first turn"
    assert c(_line("subagent", 8, 0, 0.1)) == "subagent group of 6-8: first turn"
    assert c(_line("subagent", 51, 0, 0.1)) == "subagent group of 9+: first turn"
    assert c(_line("subagent", 8, 1, 0.1)) == "subagent: later turns"
    assert c({"kind": "subagent", "ttft": 0.1, "ok": True}) == "subagent"  # an older line


def test_counts_above_the_threshold_with_each_class_mean() -> None:
    rows = [
        _line("main", 0, 0, 0.5, cached_tokens=0),
        _line("main", 0, 1, 0.1),
        _line("main", 0, 2, 0.3),
        *(_line("subagent", 6, 0, 0.4) for _ in range(3)),
        _line("subagent", 6, 0, 1.6, cached_tokens=100),
        _line("main", 0, 3, None, ok=False),  # failed: not a first token at all
    ]
    tail = ttft_tail.tail_of("x", rows, 0.35)
    assert (tail.requests, tail.above) == (7, 5)
    by = {c.name: c for c in tail.classes}
    assert (by["main: first turn"].above, by["main: first turn"].mean_uncached) == (1, 1000)
    assert (by["main: later turns"].requests, by["main: later turns"].above) == (2, 0)
    group = by["subagent group of 6-8: first turn"]
    assert (group.requests, group.above) == (4, 4)
    assert group.mean_ttft_s == pytest.approx(0.7)
    assert group.mean_uncached == pytest.approx(300)
    assert tail.mean_ttft_s == pytest.approx((0.5 + 0.1 + 0.3 + 1.2 + 1.6) / 7)


def test_the_default_threshold_is_the_best_p90_and_targets_keep_the_runs_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    fast = [_line("main", 0, t, 0.1 * (t + 1)) for t in range(10)]
    slow = [_line("main", 0, t, 0.2 * (t + 1)) for t in range(10)]
    for name, rows in (("b-slow", slow), ("a-fast", fast)):
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        (logs / f"{name}.requests.jsonl").write_text(text)
    results = {"results": [{"name": "b-slow"}, {"name": "a-fast"}]}
    (tmp_path / "results.json").write_text(json.dumps(results))

    assert list(ttft_tail.load_runs(tmp_path)) == ["b-slow", "a-fast"]
    assert ttft_tail.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    best_p90 = ttft_tail.p90_of(fast)
    assert best_p90 == pytest.approx(0.91)
    assert f"TTFT above {best_p90:.3f} s" in out
    assert out.index("#### b-slow") < out.index("#### a-fast")
    assert "#### b-slow: 6 of 10 above" in out  # 0.2 * 5 = 1.0 and up
    assert "#### a-fast: 1 of 10 above" in out


def test_a_folder_without_answers_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        ttft_tail.main([str(tmp_path)])
    assert exc.value.code == 2
