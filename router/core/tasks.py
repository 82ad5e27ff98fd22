"""Ending the background tasks a lifespan or a component owns."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended, so nothing it holds outlives the caller's
    shutdown; its cancellation ends here. ``None`` (never started) is fine."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
