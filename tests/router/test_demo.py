"""``prefixgate demo --smoke``: its table and the example commands, and nothing else."""

from __future__ import annotations

import io
import logging

import pytest

from router.api.logs import ACCESS_LOGGER, AccessLog
from router.cli import main


@pytest.mark.slow
def test_smoke_prints_the_table_and_commands_without_log_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        code = main(["demo", "--smoke", "--replicas", "2", "--port", "8123"])
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    out, err = capsys.readouterr()
    assert code == 0
    assert "replica" in out and "total" in out
    assert "curl -s http://127.0.0.1:8123/v1/chat/completions" in out
    assert "OpenAI(base_url='http://127.0.0.1:8123/v1'" in out
    assert "prefixgate demo --port 8123" in out
    assert ACCESS_LOGGER not in out + err
    assert "INFO" not in err


def test_the_cli_log_handler_writes_an_access_line_with_its_fields() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for handler in handlers:
        root.removeHandler(handler)
    stream = io.StringIO()
    try:
        # main() with a failing command still installs its logging first.
        assert main(["serve"]) == 2
        for handler in root.handlers:
            assert isinstance(handler, logging.StreamHandler)
            handler.setStream(stream)
        AccessLog().emit({"status": 200, "api": "chat", "endpoint": "127.0.0.1:8001"})
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    line = stream.getvalue()
    assert "prefixgate.access: request status=200 api=chat endpoint=127.0.0.1:8001" in line
