"""llm-d plugin types with no counterpart here, and what to use instead (the start-up error
names both; docs/llm-d-compatibility.md lists them)."""

from __future__ import annotations

_EXPERIMENTAL = "remove it (no equivalent yet)"
_MULTICLUSTER = "prefixgate routes within one pool; remove it or use the single-cluster plugin"
_TEST = "it exists for llm-d's own tests; remove it"

REFUSED: dict[str, str] = {
    # Filters.
    "encode-filter": "prefixgate has no encode stage; remove it",
    "by-label": "give each endpoint its role (pool.endpoints[].role, or discovery.roleLabel) "
                "and use decode-filter / prefill-filter",
    "by-label-selector": "give each endpoint its role (pool.endpoints[].role, or "
                         "discovery.roleLabel) and use decode-filter / prefill-filter",
    "label-selector-filter": "give each endpoint its role (pool.endpoints[].role, or "
                             "discovery.roleLabel) and use decode-filter / prefill-filter",
    "session-affinity-filter": "use session-affinity-scorer (a high weight keeps sessions home)",
    "endpoint-attribute-filter": "select endpoints with pool.endpoints or discovery",
    "topology-affinity-filter": _EXPERIMENTAL,
    "utilization-filter": "flowControl's saturation detector holds requests back instead; "
                          "remove it",
    "prefix-cache-affinity-filter": "use prefix-cache-scorer with a higher weight, or the "
                                    "default strategy (ttft-cost-scorer)",
    "slo-headroom-tier-filter": _EXPERIMENTAL,
    "header-based-testing-filter": _TEST,
    # Scorers.
    "token-load-scorer": "use the default strategy's ttft-cost-scorer, which prices the "
                         "tokens queued on each endpoint",
    "lora-affinity-scorer": "prefixgate does not route LoRA adapters; remove it",
    "context-length-aware": "use the default strategy's ttft-cost-scorer",
    "endpoint-attribute-scorer": _EXPERIMENTAL,
    "header-label-affinity-scorer": _EXPERIMENTAL,
    "topology-affinity-scorer": _EXPERIMENTAL,
    "mm-embeddings-cache-scorer": "multimodal embedding caches are not tracked; remove it",
    "latency-scorer": "use the default strategy's ttft-cost-scorer (predicted time to first "
                      "token per endpoint)",
    "multicluster-kv-cache-utilization-scorer": _MULTICLUSTER,
    "multicluster-prefix-cache-scorer": _MULTICLUSTER,
    "multicluster-queue-scorer": _MULTICLUSTER,
    "multicluster-session-affinity-filter": _MULTICLUSTER,
    # Pickers.
    "weighted-random-picker": "use max-score-picker or random-picker",
    # Profile handlers and deciders.
    "disagg-headers-handler": "use disagg-profile-handler (disaggregation.mode: sidecar sets "
                              "the prefiller header)",
    "prefill-header-handler": "use disagg-profile-handler (disaggregation.mode: sidecar sets "
                              "the prefiller header)",
    "header-profile-handler": "one profile, or disagg-profile-handler for prefill/decode",
    "always-disagg-multimodal-decider": "prefixgate has no encode stage; remove it",
    # Producers.
    "predicted-latency-producer": "use the default strategy's ttft-cost-scorer, which learns "
                                  "each endpoint's TTFT from the traffic it serves",
    "mm-embeddings-cache-producer": "multimodal embedding caches are not tracked; remove it",
    "p2p-source-producer": _EXPERIMENTAL,
    "multicluster-approx-prefix-cache-producer": _MULTICLUSTER,
    # Admission and request control.
    "latency-slo-admitter": "remove it: SLO-aware admission is built in (an objective's "
                            "ttftSloMs or the x-llm-d-slo-ttft-ms header)",
    "probabilistic-admitter": "flowControl (queues, priorities, shedding of sheddable "
                              "requests) instead",
    "request-attribute-reporter": _EXPERIMENTAL,
    "disaggregatedset-rollout-screener": _EXPERIMENTAL,
    "destination-endpoint-served-verifier": _TEST,
    # Flow control.
    "edf-ordering-policy": "requests of a flow are served first come, first served "
                           "(fcfs-ordering-policy); remove it",
    "slo-deadline-ordering-policy": "requests of a flow are served first come, first served "
                                    "(fcfs-ordering-policy); remove it",
    "static-usage-limit-policy": "use flowControl priority bands (sheddable requests are shed "
                                 "when the pool is saturated)",
    "priority-holdback-policy": "use flowControl priority bands (sheddable requests are shed "
                                "when the pool is saturated)",
    "soft-reflective-ceiling-policy": "use flowControl priority bands (a higher band is always "
                                      "dispatched first; sheddable requests are shed when "
                                      "the pool is saturated)",
    "sheddable-eviction-filter": "requests already sent upstream are never evicted; remove it "
                                 "(and flowControl.enableEviction)",
    "priority-then-time-eviction-order-policy": "requests already sent upstream are never "
                                                "evicted; remove it",
    # Data layer.
    "file-discovery": "list the endpoints in pool.endpoints or give --backend",
    "multicluster-file-discovery": _MULTICLUSTER,
    "dcgm-data-source": "GPU telemetry is not read; remove it",
    "dcgm-extractor": "GPU telemetry is not read; remove it",
    "topology-extractor": _EXPERIMENTAL,
    "multicluster-metrics-data-source": _MULTICLUSTER,
    "multicluster-metrics-extractor": _MULTICLUSTER,
    # Parsers.
    "sglanghttp-parser": "prefixgate serves OpenAI-compatible (vLLM) endpoints only",
    "vertexai-parser": "prefixgate serves OpenAI-compatible (vLLM) endpoints only",
    "vllmgrpc-parser": "prefixgate proxies HTTP; use vLLM's OpenAI-compatible server",
}
