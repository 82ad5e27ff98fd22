"""``running_gateway``, the in-process server of tests and the demo: a start-up that fails."""

from __future__ import annotations

import os

import pytest

from router.core.errors import ConfigError
from router.serve.server import running_gateway
from tests.gateways import gateway_config


async def test_a_failed_start_up_raises_in_the_caller_instead_of_exiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn exits 3 when the lifespan fails; in-process that must not be the host's
    SystemExit but the documented RuntimeError, caused by what failed."""
    for name in [k for k in os.environ if k.startswith("KUBERNETES_")]:
        monkeypatch.delenv(name)
    config = gateway_config([], discovery={"inferencePool": "pool"})
    with pytest.raises(RuntimeError, match="exited during start-up") as failed:
        async with running_gateway(config):
            pass
    assert isinstance(failed.value.__cause__, ConfigError)
