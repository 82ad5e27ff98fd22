"""An exponential average kept per model, for the estimators that learn one figure a model from
its answers (router/estimators/answer_cache.py, router/estimators/answer_lengths.py), bounded
to the models updated last so that a client naming endless models cannot grow it."""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client.core import GaugeMetricFamily


class ModelAverage:
    """Per model, ``decay`` x the average so far + (1 - ``decay``) x each new value, from
    ``prior``; without a prior, a model's first value is its average."""

    def __init__(self, decay: float, max_models: int, prior: float | None = None) -> None:
        self._decay = decay
        self._max_models = max_models
        self._prior = prior
        self._values: OrderedDict[str, float] = OrderedDict()

    def get(self, model: str) -> float | None:
        """The model's average, or the prior (None: none, and nothing seen of the model)."""
        return self._values.get(model, self._prior)

    def observe(self, model: str, value: float) -> None:
        current = self.get(model)
        d = self._decay
        self._values[model] = value if current is None else d * current + (1 - d) * value
        self._values.move_to_end(model)
        while len(self._values) > self._max_models:
            self._values.popitem(last=False)

    def gauge(self, name: str, documentation: str) -> GaugeMetricFamily:
        """The averages as a gauge labelled by model (the models seen only)."""
        gauge = GaugeMetricFamily(name, documentation, labels=["model"])
        for model, value in list(self._values.items()):
            gauge.add_metric([model], value)
        return gauge
