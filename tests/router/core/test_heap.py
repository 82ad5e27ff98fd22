"""Freezing the start-up heap: what exists is frozen, what comes later is not."""

from __future__ import annotations

import gc

from router.core.heap import freeze_startup_heap


def test_freezing_takes_what_exists_and_leaves_later_objects_collectable() -> None:
    try:
        frozen = freeze_startup_heap()
        assert frozen > 1000 and gc.get_freeze_count() == frozen
        later = [[] for _ in range(100)]  # allocated after: not in the permanent generation
        assert gc.get_freeze_count() == frozen and len(later) == 100
    finally:
        gc.unfreeze()  # this test process keeps collecting as before
    assert gc.get_freeze_count() == 0
