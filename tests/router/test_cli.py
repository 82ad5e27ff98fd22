"""The ``serve`` command's flags over the config file's keys."""

from __future__ import annotations

from pathlib import Path

from router.cli import _serve_config, build_parser


def test_workers_flag_overrides_the_config_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {workers: 2}\npool: {endpoints: [{url: 'http://127.0.0.1:9'}]}\n")
    args = build_parser().parse_args(["serve", "--config", str(path)])
    assert _serve_config(args).server.workers == 2
    args = build_parser().parse_args(["serve", "--config", str(path), "--workers", "4"])
    assert _serve_config(args).server.workers == 4
    args = build_parser().parse_args(["serve", "--backend", "http://127.0.0.1:9"])
    assert _serve_config(args).server.workers == 1, "one process unless asked"
