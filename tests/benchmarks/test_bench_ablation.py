"""Every ablation config of the sweep parses as the benchmark runner lays it out (its endpoints
added), so a sweep does not lose a target to a typo at its first world."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.config.model import parse_config

ABLATION = Path(__file__).resolve().parents[2] / "benchmarks" / "bench" / "ablation"


@pytest.mark.parametrize("path", sorted(ABLATION.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_ablation_config_parses(path: Path) -> None:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.setdefault("pool", {})["endpoints"] = [{"url": "http://127.0.0.1:9"}]
    parse_config(data)


def test_the_probe_ablation_turns_only_the_probe_off() -> None:
    data = yaml.safe_load((ABLATION / "no-speed-probe.yaml").read_text(encoding="utf-8"))
    data["pool"]["endpoints"] = [{"url": "http://127.0.0.1:9"}]
    off = parse_config(data)
    assert not off.pool.speed_probe.enabled
    same = parse_config({"strategy": "default", "pool": {"endpoints": data["pool"]["endpoints"]}})
    assert off.model_copy(update={"pool": same.pool}) == same
