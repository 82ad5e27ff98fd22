"""How far the calibrator's TTFT predictions are from the first bytes that followed them.

SLO admission rejects a sheddable request only when it will most likely miss its target, so it
discounts a prediction by how optimistic the recent ones turned out to be: the low quantile of
actual over predicted. A calibrator that overestimates (a prior not yet learned, a queue that
drains faster than priced) then rejects little; one that is accurate rejects at the target.
"""

from __future__ import annotations

import math
from collections import deque

# Recent first bytes kept, and the quantile of actual/predicted taken as "optimistic".
WINDOW = 256
QUANTILE = 0.1
# Fewer samples than this: no discount is trusted yet, so nothing is rejected on a prediction.
MIN_SAMPLES = 20


class PredictionErrors:
    def __init__(self, window: int = WINDOW, quantile: float = QUANTILE) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._quantile = quantile
        self._cached: float | None = None

    def record(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s > 0 and math.isfinite(predicted_s) and math.isfinite(actual_s):
            self._ratios.append(max(0.0, actual_s) / predicted_s)
            self._cached = None

    def optimistic_ratio(self) -> float | None:
        """The low quantile of actual/predicted over the window; None until enough samples."""
        if len(self._ratios) < MIN_SAMPLES:
            return None
        if self._cached is None:
            ordered = sorted(self._ratios)
            self._cached = ordered[int(self._quantile * (len(ordered) - 1))]
        return self._cached
