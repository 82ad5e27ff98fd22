"""The README and docs/: their configuration examples load and their links resolve, and the
keys, flags, plugins, metrics and headers they name exist in the code.

A user copies the examples first, and a page moved or renamed must not leave a dead link.
"""

from __future__ import annotations

import argparse
import random
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from router.cli import build_parser
from router.config.model import GatewayConfig, builtin_strategy, parse_config
from router.config.strategies import STRATEGIES
from router.scheduling.plugins import PluginContext, build_profile, default_registry

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "deploy" / "README.md"]
# The user's guide (the benchmark reports quote what ran at their commit).
GUIDE = [p for p in PAGES if "benchmarks" not in p.relative_to(ROOT).parts]
SOURCES = "".join(
    f.read_text(encoding="utf-8")
    for package in ("router", "scorers", "flow_control")
    for f in sorted((ROOT / package).rglob("*.py"))
)
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
    """Strictly, and with their plugins built: a plugin's parameters are checked only then."""
    config = parse_config(runnable(yaml.safe_load(block)))
    if config.plugins is None:
        plugins, profile = builtin_strategy(config.strategy)
        profiles = [profile]
    else:
        plugins, profiles = config.plugins, config.scheduling_profiles or []
    for profile in profiles:
        build_profile(plugins, profile, default_registry(), PluginContext(random.Random(0)))


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


def _fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """A config model's keys as written in YAML, each with its section's model (None: a value)."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        types = [field.annotation, *typing.get_args(field.annotation)]
        types += [a for t in types for a in typing.get_args(t)]
        sub = [t for t in types if isinstance(t, type) and issubclass(t, BaseModel)]
        out[field.alias or name] = sub[0] if sub else None
    return out


def config_paths() -> list[tuple[str, str]]:
    """Backquoted key paths that start at a top-level key (`prefixIndex.timeoutMs`,
    `pool.endpoints[].role`), outside the llm-d page, whose left column names llm-d's keys."""
    top = _fields(GatewayConfig)
    found = {
        (page.relative_to(ROOT).as_posix(), path)
        for page in GUIDE
        if page.name != "llm-d-compatibility.md"
        for path in re.findall(
            r"`([a-z][A-Za-z]*(?:(?:\[\])?\.[A-Za-z]+)+)(?::[^`]*)?`",
            page.read_text(encoding="utf-8"),
        )
        if path.split(".")[0] in top
    }
    return sorted(found)


@pytest.mark.parametrize(("page", "path"), config_paths())
def test_config_keys_named_exist(page: str, path: str) -> None:
    model: type[BaseModel] | None = GatewayConfig
    for key in path.replace("[]", "").split("."):
        assert model is not None and key in _fields(model), f"{page}: no config key {path}"
        model = _fields(model)[key]


def test_configuration_page_names_every_section() -> None:
    """README sends the user to docs/configuration.md for every key: each top-level one is
    there, or linked from there (compatibility is written by the llm-d translation)."""
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [
        key for key in _fields(GatewayConfig)
        if key != "compatibility"
        and f"`{key}" not in page and not re.search(rf"^\s*{key}:", page, re.M)
    ]
    assert not missing, f"docs/configuration.md does not mention {missing}"


def test_serve_flags_are_documented() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    flags = [f for a in serve._actions for f in a.option_strings if f.startswith("--")]
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [f for f in flags if f != "--help" and f"`{f}`" not in page]
    assert not missing, f"docs/configuration.md does not list serve's {missing}"


def test_plugins_page_names_every_plugin_type_and_strategy() -> None:
    page = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    names = [*default_registry().types(), *STRATEGIES]
    missing = [n for n in names if f"`{n}`" not in page]
    assert not missing, f"docs/plugins.md does not name {missing}"


def _metric_exists(name: str) -> bool:
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    if base.endswith("_*"):  # a family: some name built from the prefix
        prefix = base[:-1]
        built = re.findall(r'f"(prefixgate_\w+_)\{', SOURCES)  # not f"prefixgate_{...}"
        return any(prefix.startswith(p) for p in built)
    return f'"{base}"' in SOURCES or f'"{name}"' in SOURCES


def test_metric_names_exist() -> None:
    missing = sorted({
        f"{page.relative_to(ROOT).as_posix()}: {name}"
        for page in GUIDE
        for name in re.findall(r"prefixgate_[a-z0-9_]+\*?", page.read_text(encoding="utf-8"))
        if not _metric_exists(name)
    })
    assert not missing, missing


def test_header_names_exist() -> None:
    """Every x- header the guide names is one the code reads or writes."""
    missing = sorted({
        f"{page.relative_to(ROOT).as_posix()}: {name}"
        for page in GUIDE
        for name in re.findall(r"`(x-[a-z0-9-]*[a-z0-9])[`:]", page.read_text(encoding="utf-8"))
        if f'"{name}"' not in SOURCES
    })
    assert not missing, missing


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [
        p.name for p in sorted((ROOT / "docs").glob("*.md"))
        if p.name != "README.md" and f"]({p.name})" not in index
    ]
    assert not missing, f"docs/README.md does not link {missing}"


def _commented_keys(page: Path) -> list[tuple[str, str]]:
    """The ``# key: value`` lines of a page's YAML examples, each with its key's full path: a
    key left commented out in a reference example reads as "this is the default"."""
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        stack: list[tuple[int, str]] = []
        for line in block.splitlines():
            match = re.match(r"(\s*)(#\s*)?([a-z][A-Za-z]*):\s*([^#]*)", line)
            if not match:
                continue
            indent, commented, key, value = match.groups()
            stack = [(i, k) for i, k in stack if i < len(indent)]
            path = ".".join([k for _, k in stack] + [key])
            if commented:
                found.append((path, value.strip()))
            else:
                stack.append((len(indent), key))
    return found


def test_keys_commented_out_in_the_reference_show_their_default() -> None:
    wrong = []
    for path, text in _commented_keys(ROOT / "docs" / "configuration.md"):
        model: type[BaseModel] | None = GatewayConfig
        *sections, key = path.split(".")
        for section in sections:
            model = _fields(model)[section] if model is not None else None
        if model is None or text in ("", "..."):
            continue
        field = next(f for n, f in model.model_fields.items() if (f.alias or n) == key)
        if field.default is not None and yaml.safe_load(text) != field.default:
            wrong.append(f"{path}: {text} (default {field.default!r})")
    assert not wrong, f"docs/configuration.md: {wrong}"
