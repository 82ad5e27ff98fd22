"""The README's configuration examples must load: a user copies them first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from router.config import parse_config

README = Path(__file__).resolve().parent.parent / "README.md"


def yaml_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "pool:" in b or "auth:" in b]


@pytest.mark.parametrize("block", yaml_blocks())
def test_readme_config_examples_load(block: str) -> None:
    data = yaml.safe_load(block)
    if "pool" not in data or "endpoints" not in data.get("pool", {}):
        data.setdefault("pool", {})["endpoints"] = [{"url": "http://127.0.0.1:8001"}]
    for section in ("auth",):
        for entry in data.get(section, {}).get("apiKeys", []):
            entry.pop("keyEnv", None)
            entry["key"] = "k" * 32
        data.get(section, {}).pop("apiKeysEnv", None)
    if data.get("pool", {}).get("apiKey") == "...":
        data["pool"]["apiKey"] = "upstream-key"
    parse_config(data)


def test_there_are_examples() -> None:
    assert len(yaml_blocks()) >= 3
