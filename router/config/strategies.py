"""Built-in strategies: the default, the llm-d-style weighted profile, and baselines.

``default`` prices every endpoint in one common unit, the predicted time to first token
(scorers/ttft_cost.py); docs/benchmarks/routing-quality.md measures it against the weighted
profile, the baselines and the peer routers at two load levels and two KV capacities.
``weighted`` is llm-d's weighted sum of [0, 1] scores, for users who want that model or to tune
weights themselves. ``precise`` is the default reading the replicas' KV events instead of
guessing what they hold; ``precise-weighted`` is the weighted profile reading them.

Each is plain config (plugins + one profile), exactly what a user could write in YAML, so a
baseline is never a special code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StrategySpec:
    """A built-in strategy as the plain values a user would write: scorer weights and a picker.

    Plain data, so the config model can name the strategies without this module importing it;
    ``router.config.model.builtin_strategy`` turns a spec into plugin and profile models.
    """

    weights: dict[str, float]
    picker: str = "max-score-picker"
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)


# Weights: llm-d's defaults for prefix (3), queue (2) and KV utilization (2), plus the gateway's
# own in-flight count (2) which, unlike scraped metrics, is never stale inside a burst, and
# session affinity (1) which keeps a session home when its prefix score alone is ambiguous.
_DEFAULT_WEIGHTS = {
    "prefix-cache-scorer": 3.0,
    "queue-scorer": 2.0,
    "kv-cache-utilization-scorer": 2.0,
    "inflight-scorer": 2.0,
    "session-affinity-scorer": 1.0,
}

STRATEGIES: dict[str, StrategySpec] = {
    # Predicted time to first token in one common unit (scorers/ttft_cost.py).
    "default": StrategySpec({"ttft-cost-scorer": 1.0}),
    "weighted": StrategySpec(_DEFAULT_WEIGHTS),
    "round-robin": StrategySpec({}, "round-robin-picker"),
    "random": StrategySpec({}, "random-picker"),
    "least-loaded": StrategySpec({"inflight-scorer": 1.0}),
    "prefix-only": StrategySpec({"prefix-cache-scorer": 1.0}),
    "session-hash": StrategySpec({"session-hash-scorer": 1.0}),
    # The default, with the prefix hits read from the replicas' KV events. It measured better
    # than the weighted profile on them; against the approximate default it wins on some
    # workloads and loses on others (docs/benchmarks/precise.md).
    "precise": StrategySpec(
        {"ttft-cost-scorer": 1.0}, parameters={"ttft-cost-scorer": {"prefixSource": "precise"}}
    ),
    # The weighted profile with the precise prefix share (llm-d's precise mode).
    "precise-weighted": StrategySpec(
        {("precise-prefix-cache-scorer" if t == "prefix-cache-scorer" else t): w
         for t, w in _DEFAULT_WEIGHTS.items()}
    ),
}
