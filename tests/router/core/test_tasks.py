"""Ending a background task: cancelled, awaited, its cancellation kept inside."""

from __future__ import annotations

import asyncio

from router.core.tasks import cancel_all, cancel_and_wait


async def test_cancel_and_wait_ends_the_task_and_runs_its_cleanup() -> None:
    cleaned: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("done")

    task = asyncio.create_task(forever())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 2)  # no CancelledError out of here
    assert task.cancelled() and cleaned == ["done"]
    await cancel_and_wait(task)  # an ended task, again: harmless
    await cancel_and_wait(None)  # never started


async def test_cancel_all_ends_every_task_of_the_map_and_empties_it() -> None:
    ended: list[str] = []

    async def runs(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    async def failed() -> None:
        raise ValueError("ended with an error before the shutdown")

    tasks = {name: asyncio.create_task(runs(name)) for name in ("a", "b")}
    tasks["c"] = asyncio.create_task(failed())
    await asyncio.sleep(0)  # each task starts (and c fails) before the shutdown
    await cancel_all(tasks)
    assert tasks == {} and sorted(ended) == ["a", "b"]
