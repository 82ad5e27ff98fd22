"""Ending the background tasks a lifespan or a component owns."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import MutableMapping
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended, so nothing it holds outlives the caller's
    shutdown; its cancellation ends here. ``None`` (never started) is fine."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def cancel_all(tasks: MutableMapping[str, asyncio.Task[Any]]) -> None:
    """Cancel every task of a component's per-key map (one per endpoint, say), empty the map,
    and wait until they have all ended; an error one ended with is not the shutdown's."""
    ending = list(tasks.values())
    tasks.clear()
    for task in ending:
        task.cancel()
    await asyncio.gather(*ending, return_exceptions=True)
