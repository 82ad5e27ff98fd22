"""The README and docs/: their configuration examples load and their links resolve.

A user copies the examples first, and a page moved or renamed must not leave a dead link.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config.model import parse_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"```.*?```", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+\s+(.*)$", re.M)


def yaml_blocks() -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), block)
        for page in PAGES
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    ]


def links() -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), target)
        for page in PAGES
        for target in _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))
        if not re.match(r"[a-z]+://", target)
    ]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    slugs = (re.sub(r"[^\w\- ]", "", h.strip().lower()) for h in _HEADING.findall(text))
    return {slug.replace(" ", "-") for slug in slugs}


def runnable(data: dict[str, Any]) -> dict[str, Any]:
    """Fill what an excerpt leaves out or points elsewhere (a pool, keys from the environment)."""
    pool = data.setdefault("pool", {})
    pool.setdefault("endpoints", [{"url": "http://127.0.0.1:8001"}])
    if pool.get("apiKey") == "...":
        pool["apiKey"] = "upstream-key"
    auth = data.get("auth", {})
    for entry in auth.get("apiKeys", []):
        entry.pop("keyEnv", None)
        entry["key"] = "k" * 32
    auth.pop("apiKeysEnv", None)
    return data


@pytest.mark.parametrize(("page", "block"), yaml_blocks())
def test_config_examples_load(page: str, block: str) -> None:
    parse_config(runnable(yaml.safe_load(block)))


@pytest.mark.parametrize(("page", "target"), links())
def test_links_resolve(page: str, target: str) -> None:
    source = ROOT / page
    path, _, fragment = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    assert dest.exists(), f"{page}: no such file {target}"
    if fragment:
        heading_page = dest / "README.md" if dest.is_dir() else dest
        assert fragment in anchors(heading_page), f"{page}: no heading for #{fragment}"


def test_there_are_examples_and_links() -> None:
    assert len(yaml_blocks()) >= 5
    assert len(links()) >= 50


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300
