"""The ``prefixgate`` command line: how ``serve`` turns its flags into a config."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import _serve_config, build_parser
from router.core.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_backend_supplies_the_pool_of_a_config_without_one(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("strategy: weighted\nserver: {port: 9100}\n")
    config = _serve_config(_args("--config", str(path), "--backend", "http://127.0.0.1:8001"))
    assert [e.url for e in config.pool.endpoints] == ["http://127.0.0.1:8001"]
    assert config.strategy == "weighted" and config.server.port == 9100


def test_backend_adds_to_the_configured_pool_once(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pool:\n  endpoints:\n  - {url: 'http://127.0.0.1:8001', role: prefill}\n"
    )
    config = _serve_config(
        _args(
            "--config", str(path),
            "--backend", "http://127.0.0.1:8001/",
            "--backend", "http://127.0.0.1:8002",
        )
    )
    assert [(e.url, e.role) for e in config.pool.endpoints] == [
        ("http://127.0.0.1:8001", "prefill"),
        ("http://127.0.0.1:8002", "both"),
    ]


def test_backend_alone_and_a_bad_backend() -> None:
    config = _serve_config(_args("--backend", "http://127.0.0.1:8001"))
    assert [e.url for e in config.pool.endpoints] == ["http://127.0.0.1:8001"]
    with pytest.raises(ConfigError, match="--backend"):
        _serve_config(_args("--backend", "ftp://nowhere"))
    with pytest.raises(ConfigError, match="--config FILE or at least one --backend"):
        _serve_config(_args())


def test_workers_flag_overrides_the_config_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {workers: 2}\npool: {endpoints: [{url: 'http://127.0.0.1:9'}]}\n")
    args = build_parser().parse_args(["serve", "--config", str(path)])
    assert _serve_config(args).server.workers == 2
    args = build_parser().parse_args(["serve", "--config", str(path), "--workers", "4"])
    assert _serve_config(args).server.workers == 4
    args = build_parser().parse_args(["serve", "--backend", "http://127.0.0.1:9"])
    assert _serve_config(args).server.workers == 1, "one process unless asked"


def test_a_config_error_found_at_start_up_exits_2_with_its_message(tmp_path: Path) -> None:
    """Kubernetes discovery outside a cluster fails in the lifespan, after the gateway was
    built: ``serve`` reports it as every other configuration error (exit 2, one line)."""
    path = tmp_path / "gateway.yaml"
    path.write_text("server: {port: 0}\ndiscovery: {inferencePool: pool}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "prefixgate: discovery.apiServer: not set" in done.stderr


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a traceback from logging: argparse names the flag and the levels it takes."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--log-level", "verbose"])
    assert info.value.code == 2
    assert "--log-level" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--log-level", "WARNING"])
    assert args.log_level == "warning"


def test_a_config_with_no_endpoints_and_no_discovery_fails_at_start_up(tmp_path: Path) -> None:
    """Nothing to route to, ever: every request would be a 503 while /health says alive."""
    path = tmp_path / "gateway.yaml"
    path.write_text("server: {port: 0}\nstrategy: weighted\n")
    with pytest.raises(ConfigError, match=r"pool\.endpoints: .*--backend.*discovery"):
        _serve_config(_args("--config", str(path)))
    assert _serve_config(_args("--config", str(path), "--backend", "http://127.0.0.1:9"))
