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

from typing import Any

from router.config import PluginConfig, PluginRef, ProfileConfig

Strategy = tuple[list[PluginConfig], ProfileConfig]

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


def _weighted(
    weights: dict[str, float],
    picker: str = "max-score-picker",
    parameters: dict[str, dict[str, Any]] | None = None,
) -> Strategy:
    params = parameters or {}
    plugins = [PluginConfig(type=t, parameters=params.get(t, {})) for t in weights]
    plugins.append(PluginConfig(type=picker))
    refs = [PluginRef(plugin_ref=t, weight=w) for t, w in weights.items()]
    refs.append(PluginRef(plugin_ref=picker))
    return plugins, ProfileConfig(name="default", plugins=refs)


STRATEGIES: dict[str, Strategy] = {
    # Predicted time to first token in one common unit (scorers/ttft_cost.py).
    "default": _weighted({"ttft-cost-scorer": 1.0}),
    "weighted": _weighted(_DEFAULT_WEIGHTS),
    "round-robin": _weighted({}, "round-robin-picker"),
    "random": _weighted({}, "random-picker"),
    "least-loaded": _weighted({"inflight-scorer": 1.0}),
    "prefix-only": _weighted({"prefix-cache-scorer": 1.0}),
    "session-hash": _weighted({"session-hash-scorer": 1.0}),
    # The default, with the prefix hits read from the replicas' KV events. It measured better
    # than the weighted profile on them; against the approximate default it wins on some
    # workloads and loses on others (README, "Precise prefix routing").
    "precise": _weighted(
        {"ttft-cost-scorer": 1.0}, parameters={"ttft-cost-scorer": {"prefixSource": "precise"}}
    ),
    # The weighted profile with the precise prefix share (llm-d's precise mode).
    "precise-weighted": _weighted(
        {("precise-prefix-cache-scorer" if t == "prefix-cache-scorer" else t): w
         for t, w in _DEFAULT_WEIGHTS.items()}
    ),
}


def strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown strategy {name!r} (known: {known})") from None
