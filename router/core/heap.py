"""The process's start-up heap, taken out of the garbage collector's full passes.

A full collection walks every tracked object, and about 90K of them (FastAPI, pydantic, aiohttp,
the config, the app) are built at start-up and live until exit: walking them stalled every
stream each time one ran (docs/benchmarks/gateway-cost.md). ``gc.freeze()`` moves them to a
permanent generation that collections skip, as preforking servers do before they fork; what is
left to walk is what the running gateway itself allocates.

Freezing is process-wide, so only the CLI's own serve paths call it, never an in-process gateway
(tests, an embedding application).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze the rest; how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
