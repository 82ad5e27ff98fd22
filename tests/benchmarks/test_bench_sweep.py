"""A tiny sweep end to end: two drawn worlds, two targets, real processes and sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench.settings import BenchSettings
from benchmarks.bench.sweep import SweepSpec, world_settings
from benchmarks.bench.world_build import build_world
from benchmarks.bench.worlds import draw_worlds
from router.cli import main

pytestmark = pytest.mark.slow


def _trace(path: Path, rows: int = 300) -> Path:
    lines = []
    for i in range(rows):
        ids = [0, 1000 + i % 9, *range(10_000 + 10 * i, 10_000 + 10 * i + i % 4)]
        lines.append(json.dumps({"timestamp": i * 250, "input_length": 512 * len(ids) - 100,
                                 "output_length": 40 + i % 50, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(240)
def test_a_tiny_sweep_runs_every_target_in_every_world(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    # Seed 1 with two replicas at most draws a trace world, then an agentic one.
    code = main([
        "bench", "--sweep", "2", "--sweep-seed", "1", "--sweep-scale", "0.1",
        "--replicas", "2", "--strategies", "round-robin,default-nofc", "--peers", "none",
        "--trace", str(_trace(tmp_path / "trace.jsonl")), "--no-progress", "--no-plots",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert [w["world"]["workload"] for w in data["worlds"]] == ["trace", "agentic"]
    for w in data["worlds"]:
        assert w["error"] == ""
        assert [r["name"] for r in w["results"]] == ["round-robin", "default-nofc"]
        for r in w["results"]:
            assert r["status"] == "ok", r["note"]
            assert r["errors"] == 0 and r["incomplete"] == 0
            assert r["requests"] == w["built"]["requests"] > 0
        assert (out / f"world-{w['world']['index']:02d}" / "results.json").exists()
    # Per metric, each target ranked in both worlds, and some target the best in each.
    for metric in ("p90", "mean", "p99"):
        stats = {s["target"]: s for s in data["summary"][metric]}
        assert set(stats) == {"round-robin", "default-nofc"}
        assert all(s["worlds"] == 2 for s in stats.values())
        for world in (0, 1):
            best = min(r for s in stats.values() for w, r in s["ratios"] if w == world)
            assert best == pytest.approx(1.0)
    # The flow-control variant ran with flow control off.
    config = (out / "world-00" / "logs" / "default-nofc.yaml").read_text()
    assert "flowControl:\n  enabled: false" in config
    md = (out / "results.md").read_text()
    assert "| default-nofc | p90 | 2 |" in md and "## world 1: agentic" in md
    # In each world, the target that was not the best has an interval of its p90 ratio, and
    # the summary lists the clear losses (an interval wholly above 1.10x) from those.
    for w in data["worlds"]:
        assert len(w["p90_intervals"]) == 1
        ((name, (low, high)),) = w["p90_intervals"].items()
        assert low <= high and name in ("round-robin", "default-nofc")
    clear = {t: [i[0] for i in ls] for t, ls in data["clear_p90_losses"].items()}
    assert clear == {t: [w["world"]["index"] for w in data["worlds"]
                         if w["p90_intervals"].get(t, (0.0,))[0] > 1.10]
                     for t in ("round-robin", "default-nofc")}


@pytest.mark.timeout(180)
def test_a_repeated_world_pools_its_runs(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code = main([
        "bench", "--sweep", "2", "--sweep-seed", "1", "--sweep-scale", "0.1", "--sweep-only", "0",
        "--sweep-repeat", "2", "--replicas", "2", "--strategies", "round-robin,session-hash",
        "--peers", "none", "--trace", str(_trace(tmp_path / "trace.jsonl")), "--no-progress",
        "--no-plots", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    (world,) = data["worlds"]
    assert data["sweep"]["repeat"] == 2 and world["error"] == ""
    runs = [json.loads((out / d / "results.json").read_text())["results"]
            for d in ("world-00", "world-00/repeat-1")]
    # The second run went in reverse order; the pooled result has both runs' requests.
    assert [r["name"] for r in runs[1]] == ["session-hash", "round-robin"]
    for r in world["results"]:
        one = [next(x for x in run if x["name"] == r["name"]) for run in runs]
        assert r["requests"] == sum(x["requests"] for x in one) == 2 * world["built"]["requests"]
        assert r["runs_p90"] == pytest.approx([x["ttft"]["p90"] for x in one])


def test_world_settings_carry_the_drawn_replicas(tmp_path: Path) -> None:
    world = next(w for w in draw_worlds(30, seed=4) if any(f > 1 for f in w.slow))
    built = build_world(world, 0.2)
    s = world_settings(BenchSettings(out=tmp_path, sim_args=["--seed", "3"]), built)
    assert (s.replicas, s.block_size, s.max_num_seqs) == (
        world.replicas, world.block_size, world.max_num_seqs)
    assert s.num_gpu_blocks == built.num_gpu_blocks and s.speed == built.speed
    assert s.sim_args[:2] == ["--seed", "3"] and "--prefill-mode" in s.sim_args
    assert len(s.replica_sim_args) == world.replicas
    assert s.out == tmp_path / f"world-{world.index:02d}"
    again = world_settings(BenchSettings(out=tmp_path), built, rep=1)  # --sweep-repeat's 2nd
    assert again.out == s.out / "repeat-1"
    assert SweepSpec(1, 0).strategies[-1] == "default-nofc"


def test_tokenizer_density_goes_to_the_bench_setting(tmp_path: Path) -> None:
    """The bench's own density setting runs the replicas and the client's reuse ledger alike."""
    built = build_world(draw_worlds(1, seed=0)[0], 0.2)
    s = world_settings(BenchSettings(out=tmp_path), built)
    assert s.bytes_per_token == built.world.bytes_per_token
    assert "--bytes-per-token" not in s.sim_args


def test_sweep_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "o"
    base = ["bench", "--out", str(out), "--peers", "none"]
    assert main([*base, "--sweep", "0"]) == 2
    assert main([*base, "--sweep", "2", "--sweep-scale", "0"]) == 2
    assert main([*base, "--sweep", "2", "--sweep-repeat", "0"]) == 2
    assert main([*base, "--sweep", "2", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert main([*base, "--sweep", "2", "--sweep-only", "one"]) == 2
    assert main([*base, "--sweep", "2", "--strategies", "bogus"]) == 2
    assert main([*base, "--sweep", "2", "--strategies", "default", "--sweep-unranked",
                 "weighted"]) == 2  # not a target of the sweep
    assert not out.exists()
