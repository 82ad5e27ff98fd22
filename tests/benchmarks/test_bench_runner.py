"""The runner end to end (replicas and gateways in their own processes), targets and the CLI."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks import ttft_tail
from benchmarks.bench.runner import Runner
from benchmarks.bench.settings import BenchSettings
from benchmarks.bench.targets import PEERS, Peer, make_targets, peer_dirs
from benchmarks.workloads import Conversation, Step, build_workload
from router.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(90)
async def test_strategies_on_two_replicas(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = BenchSettings(
        out=tmp_path, replicas=2, speed=20.0, num_gpu_blocks=512, deadline_s=30.0,
        plots=False, progress=False, peer_dirs=[tmp_path / "no-peers"], redis_url=redis_url,
    )  # fmt: skip
    workload = build_workload("agentic", "tiny", sessions=3, turns=2)
    names = ["default", "round-robin", "default-redis-2gw"]
    targets = make_targets(names, ["smg-cache_aware"], settings)
    report = await Runner(settings, workload).run(targets)

    by_name = {r.name: r for r in report.results}
    assert by_name["smg-cache_aware"].status == "skipped"
    assert "not installed" in by_name["smg-cache_aware"].note
    for name in names:
        r = by_name[name]
        assert r.status == "ok", r.note
        assert (r.requests, r.errors, r.incomplete) == (workload.num_requests, 0, 0)
        assert r.ttft is not None and r.ttft.n == workload.num_requests
        assert 0 < r.ttft.p50 <= r.ttft.p90 <= r.e2e.p90  # type: ignore[union-attr]
        # Sub-agents and later turns reuse prefixes; the replicas' counters must show it.
        assert 0 < r.cached_ratio < 1 and 0 < r.captured <= 1.0
        assert r.client_cached_ratio == pytest.approx(r.cached_ratio, abs=0.02)
        assert r.reusable_fraction == pytest.approx(report.estimate.fraction, abs=0.1)
        assert sum(r.per_replica_requests) == workload.num_requests
    assert (tmp_path / "logs" / "sim.log").exists()
    # The two gateways of the Redis variant shared one index, in a namespace of their own.
    configs = [(tmp_path / "logs" / f"default-redis-2gw-{i}.yaml").read_text() for i in (0, 1)]
    namespaces = [line for c in configs for line in c.splitlines() if "namespace:" in line]
    assert len(namespaces) == 2 and namespaces[0] == namespaces[1], namespaces
    assert all(redis_url in c for c in configs)
    # Each request line names its place in the script: the burst it came in and its turn.
    lines = (tmp_path / "logs" / "default.requests.jsonl").read_text().splitlines()
    places = sorted((r["kind"], r["group"], r["turn"]) for r in map(json.loads, lines))
    assert places == sorted(_script_places(workload.conversations))
    assert any(group > 1 for _, group, _ in places)
    assert ttft_tail.main([str(tmp_path)]) == 0
    assert "subagent group of 2-3: first turn" in capsys.readouterr().out


@pytest.mark.timeout(90)
async def test_a_gateway_of_two_workers(tmp_path: Path) -> None:
    settings = BenchSettings(
        out=tmp_path, replicas=2, speed=20.0, num_gpu_blocks=512, deadline_s=30.0,
        plots=False, progress=False, peer_dirs=[tmp_path / "no-peers"],
    )  # fmt: skip
    workload = build_workload("agentic", "tiny", sessions=3, turns=2)
    report = await Runner(settings, workload).run(make_targets(["default-2w"], [], settings))
    (r,) = report.results
    assert r.status == "ok", r.note
    assert (r.requests, r.errors, r.incomplete) == (workload.num_requests, 0, 0)
    assert 0 < r.cached_ratio < 1
    assert "workers: 2" in (tmp_path / "logs" / "default-2w.yaml").read_text()


def _script_places(conversations: Sequence[Conversation]) -> list[tuple[str, int, int]]:
    def walk(kind: str, steps: Sequence[Step], group: int) -> list[tuple[str, int, int]]:
        out = []
        for turn, step in enumerate(steps):
            out.append((kind, group, turn))
            for agent in step.burst:
                out += walk("subagent", agent.steps, len(step.burst))
        return out

    return [p for c in conversations for p in walk(c.kind, c.steps, 0)]


@pytest.mark.timeout(60)
async def test_precise_on_two_gateways_routes_on_the_replicas_kv_events(tmp_path: Path) -> None:
    settings = BenchSettings(
        out=tmp_path, replicas=2, speed=20.0, num_gpu_blocks=512, deadline_s=30.0,
        plots=False, progress=False, gateway_log_level="debug",
    )  # fmt: skip
    workload = build_workload("agentic", "tiny", sessions=3, turns=2)
    report = await Runner(settings, workload).run(make_targets(["precise-2gw"], [], settings))
    result = report.results[0]
    assert result.status == "ok", result.note
    assert (result.requests, result.errors) == (workload.num_requests, 0)
    # Each gateway subscribed to both replicas' events on its own.
    for gateway in ("precise-2gw-0", "precise-2gw-1"):
        metrics = (tmp_path / "logs" / f"{gateway}.metrics.txt").read_text()
        trusted = [line for line in metrics.splitlines()
                   if line.startswith("prefixgate_kv_events_trusted{")]
        assert len(trusted) == 2 and all(line.endswith(" 1.0") for line in trusted), trusted
        batches = [line for line in metrics.splitlines()
                   if line.startswith("prefixgate_kv_event_batches_total{")]
        assert len(batches) == 2 and all(float(line.rsplit(" ", 1)[1]) > 0 for line in batches)
    # Each request's record names its session and the decision one gateway logged for it;
    # the client alternated, so both decided.
    lines = (tmp_path / "logs" / "precise-2gw.requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == workload.num_requests
    logs = [(tmp_path / "logs" / f"precise-2gw-{i}.log").read_text() for i in (0, 1)]
    for r in records:
        assert r["ok"] and r["session"] and r["ttft"] > 0
        marker = f"prefixgate.decision: request {r['request_id']}: "
        assert sum(marker in log for log in logs) == 1
    assert all("prefixgate.decision: request " in log for log in logs)


async def test_unknown_targets_fail_before_anything_starts(tmp_path: Path) -> None:
    settings = BenchSettings(out=tmp_path)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_targets(["fastest"], [], settings)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_targets(["fastest-2gw"], [], settings)
    with pytest.raises(ValueError, match="unknown peer"):
        make_targets([], ["nginx"], settings)
    with pytest.raises(ValueError, match="no config file"):
        make_targets([f"mine={tmp_path / 'missing.yaml'}"], [], settings)


def test_peer_binaries_are_found_in_peer_dirs_or_by_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFIXGATE_SMG", raising=False)
    monkeypatch.setenv("PREFIXGATE_PEERS_DIR", str(tmp_path / "env-dir"))
    # Peers installed where docs/benchmarks says (~/.cache/prefixgate-peers) must not leak in.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    dirs = peer_dirs([tmp_path / "flag-dir"])
    cache = tmp_path / "home" / ".cache" / "prefixgate-peers"
    assert dirs == [tmp_path / "flag-dir", tmp_path / "env-dir", cache]
    settings = BenchSettings(out=tmp_path, peer_dirs=dirs)
    peer = Peer("smg-cache_aware", PEERS["smg-cache_aware"], settings)
    assert peer.unavailable() is not None
    binary = tmp_path / "env-dir" / "smg" / "bin" / "smg"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert peer.binary == binary and peer.unavailable() is None
    args = peer.args(binary, 1, 2, ["http://127.0.0.1:3"])
    # Bound to loopback, metrics included (smg defaults to 0.0.0.0 for both).
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--prometheus-host") + 1] == "127.0.0.1"
    monkeypatch.setenv("PREFIXGATE_SMG", str(tmp_path / "nowhere"))
    assert peer.binary is None


def test_cli_lists_and_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--list", "--peers-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "round-robin" in listing and "default-redis-2gw" in listing
    assert "<strategy>-2gw" in listing
    assert "vllm-router-cache_aware" in listing and "burst_prob" in listing
    out = str(tmp_path / "o")
    assert main(["bench", "--strategies", "bogus", "--out", out]) == 2
    assert main(["bench", "--set", "nope=1", "--out", out]) == 2
    assert main(["bench", "--strategies", "none", "--peers", "none", "--out", out]) == 2
    assert not os.path.exists(out)


@pytest.mark.timeout(60)
def test_cli_runs_and_writes_its_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main([
        "bench", "--workload", "shared-prefix", "--preset", "tiny", "--replicas", "2",
        "--strategies", "session-hash", "--peers", "none", "--speed", "20",
        "--num-gpu-blocks", "256", "--no-plots", "--no-progress", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    (result,) = data["results"]
    assert result["name"] == "session-hash" and result["status"] == "ok"
    assert result["errors"] == 0 and result["requests"] == data["workload"]["requests"]
    assert "| session-hash |" in (out / "results.md").read_text()


def test_replicas_with_their_own_flags_get_their_own_simulator(tmp_path: Path) -> None:
    from benchmarks.bench.runner import sim_processes

    fast, slow = ["--itl-ms", "10"], ["--itl-ms", "30"]
    settings = BenchSettings(out=tmp_path, replicas=4, sim_args=["--prefill-mode", "serial"],
                             replica_sim_args=[slow, fast, fast, slow])
    procs = sim_processes(settings, 30000)
    assert [name for name, _ in procs] == ["sim", "sim-1", "sim-3"]
    for (_, cmd), (base, n, flags) in zip(
        procs, [(30000, 1, slow), (30001, 2, fast), (30003, 1, slow)], strict=True
    ):
        assert cmd[cmd.index("--base-port") + 1] == str(base)
        assert cmd[cmd.index("--replicas") + 1] == str(n)
        assert cmd[-2:] == flags and "serial" in cmd  # per-replica flags come last: they win
    assert [n for n, _ in sim_processes(BenchSettings(out=tmp_path, replicas=3), 1)] == ["sim"]
    with pytest.raises(ValueError, match="replica_sim_args"):
        sim_processes(BenchSettings(out=tmp_path, replicas=3, replica_sim_args=[fast]), 1)


@pytest.mark.timeout(90)
def test_cli_runs_replicas_and_reuse_ledger_at_one_density(tmp_path: Path) -> None:
    """Replicas and the client's ledger count the same tokens: what a replica served from its
    cache is a sane share of what the ledger says could be (at 4 bytes a token against 9 it
    would be ~2.25x too small)."""
    out = tmp_path / "out"
    code = main([
        "bench", "--workload", "agentic", "--preset", "tiny", "--replicas", "2",
        "--strategies", "session-hash", "--peers", "none", "--speed", "20",
        "--bytes-per-token", "9", "--num-gpu-blocks", "512", "--no-plots", "--no-progress",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    (result,) = data["results"]
    assert result["status"] == "ok" and result["errors"] == 0
    assert data["settings"]["bytes_per_token"] == 9.0
    assert 0.8 <= result["captured"] <= 1.0


async def test_replicas_started_are_stopped_when_a_later_one_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.bench import runner

    started: list[str] = []
    stopped: list[str] = []

    class Child:
        def __init__(self, name: str, args: Sequence[str], log_path: Path) -> None:
            if started:
                raise OSError("no more processes")
            self.name = name
            started.append(name)

        async def stop(self) -> None:
            stopped.append(self.name)

    monkeypatch.setattr(runner, "Process", Child)
    fast, slow = ["--itl-ms", "10"], ["--itl-ms", "30"]
    settings = BenchSettings(out=tmp_path, replicas=2, replica_sim_args=[fast, slow],
                             plots=False, progress=False)
    workload = build_workload("agentic", "tiny", sessions=1, turns=1)
    with pytest.raises(OSError, match="no more processes"):
        await Runner(settings, workload).run([])
    assert started == stopped == ["sim"]
