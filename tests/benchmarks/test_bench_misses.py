from __future__ import annotations

from benchmarks.bench.client import RequestRecord
from benchmarks.bench.misses import ReuseMisses, reuse_misses


def rec(at: float, session: str, dest: str | None, reusable: int, cached: int,
        ok: bool = True) -> RequestRecord:
    return RequestRecord(
        "main", at, 200 if ok else 500, ok, reusable_tokens=reusable, cached_tokens=cached,
        destination=dest, session=session,
    )  # fmt: skip


def test_misses_are_put_down_to_placement_moves_and_evictions_at_home() -> None:
    records = [
        rec(0.0, "s1", "a", 0, 0),  # nothing reusable yet
        rec(0.1, "s2", "b", 900, 100),  # placed away from s1's shared prompt: 800 missed
        rec(1.0, "s1", "a", 1000, 1000),  # home, all hit
        rec(2.0, "s2", "c", 1500, 0),  # moved: 1500 missed
        rec(3.0, "s2", "c", 2000, 1700),  # home again, 300 evicted
        rec(4.0, "s1", "b", 500, 0, ok=False),  # failed: not counted
    ]
    m = reuse_misses(reversed(records))  # order is by send time, not by list order
    assert m == ReuseMisses(reusable=5400, placed=800, moved=1500, at_home=300)
    assert m.cell() == "14.8 / 27.8 / 5.6"


def test_a_router_that_does_not_name_its_destinations_gets_no_split() -> None:
    m = reuse_misses([rec(0.0, "s", "a", 100, 0), rec(1.0, "s", None, 100, 0)])
    assert not m.known and m.reusable == 200 and m.cell() == "-"
    assert ReuseMisses().cell() == "-"  # nothing reusable
