"""Fixtures of the index tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """Objects to close at the end of the test, whatever happens."""
    objs: list[Any] = []
    yield objs
    for obj in objs:
        await obj.aclose()
