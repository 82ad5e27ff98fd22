"""llm-d plugin types and what each becomes here (docs/llm-d-compatibility.md lists them all).

Three outcomes per type:

- *implemented*: the same plugin, same name and parameters (``decode-filter``,
  ``queue-scorer``, ``load-aware-scorer``, ``no-hit-lru-scorer``, ...);
- *mapped*: the concept exists under another shape, usually a section of the gateway config
  (``approx-prefix-cache-producer`` sizes ``prefixIndex``, ``disagg-profile-handler`` turns on
  ``disaggregation``, ``program-aware-fairness`` is a flow-control fairness policy);
- *refused*: no counterpart; start-up fails naming the plugin and what to use instead.

Each rule reads its plugin's parameters through :class:`~router.config.llmd_params.Params`, so an
unknown key fails and a known but meaningless one is logged once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from router.config.llmd_flow import FLOW_RULES
from router.config.llmd_handlers import HANDLER_RULES
from router.config.llmd_params import (
    Params,
    Rule,
    State,
    check,
    duration,
    duration_seconds,
    mapping,
    unknown,
)
from router.config.llmd_refused import REFUSED
from router.core.errors import ConfigError
from router.core.hashing import BYTES_PER_TOKEN, DEFAULT_BLOCK_BYTES


def _same(native_type: str) -> Rule:
    """A plugin implemented here under its llm-d name, without parameters."""

    def rule(state: State, name: str, p: Params) -> None:
        p.done()
        state.add(name, native_type)

    return rule


def _picker(native_type: str) -> Rule:
    def rule(state: State, name: str, p: Params) -> None:
        p.ignore("the picker ranks every candidate; the ones after the first are fallbacks "
                 "for a retry", maxNumOfEndpoints=int)
        p.done()
        state.add(name, native_type)

    return rule


def _load_aware(state: State, name: str, p: Params) -> None:
    threshold = p.get("threshold", int, 128)
    p.done()
    # llm-d falls back to its default for a threshold <= 0.
    state.add(name, "load-aware-scorer", {"threshold": threshold if threshold > 0 else 128})


def _no_hit_lru(state: State, name: str, p: Params) -> None:
    size = p.get("lruSize", int, 1024)
    p.ignore("cold requests are those no endpoint holds any block of, on the prefix index",
             prefixPluginType=str, prefixPluginName=str, prefixMatchInfoProducerName=str)
    p.done()
    state.add(name, "no-hit-lru-scorer", {"lruSize": size if size > 0 else 1024})


# The prefix-cache-scorer's parameters before llm-d split out its producer (GIE's samples
# still carry them): the producer's sizing, set on the scorer.
_SIZING = ("hashBlockSize", "blockSize", "blockSizeTokens", "maxPrefixBlocksToMatch",
           "maxPrefixTokensToMatch", "lruCapacityPerServer", "autoTune")


def _prefix_scorer(state: State, name: str, p: Params) -> None:
    if any(p.has(key) for key in _SIZING):
        _index_sizing(state, p)
    producer = p.get("prefixMatchInfoProducerName", str, "")
    given = [key for key in ("matchLengthWeight", "matchLengthScaleTokens") if p.has(key)]
    weight = p.get("matchLengthWeight", float, 0.0)
    check(0.0 <= weight <= 1.0, p.at("matchLengthWeight"), "must be between 0 and 1", weight)
    scale = p.get("matchLengthScaleTokens", int, 0)
    check(weight == 0 or scale > 0, p.at("matchLengthScaleTokens"),
          "must be > 0 when matchLengthWeight is above 0", scale)
    for key in given:
        state.notes.ignore(f"{p.at(key)} (prefix-cache-scorer)",
                           "the score is the share of the prompt held, without a length bonus")
    p.done()
    if producer and producer not in state.producers:
        raise ConfigError(f"{p.at('prefixMatchInfoProducerName')}: no producer named "
                          f"{producer!r} among the plugins")
    precise = state.producers.get(producer) == "precise-prefix-cache-producer"
    state.add(name, "precise-prefix-cache-scorer" if precise else "prefix-cache-scorer")


def _precise_scorer(state: State, name: str, p: Params) -> None:
    """llm-d's older all-in-one precise scorer: producer parameters, then a scorer."""
    _precise_parameters(state, p)
    state.add(name, "precise-prefix-cache-scorer")


def _inflight(why: str) -> Rule:
    def rule(state: State, name: str, p: Params) -> None:
        p.ignore(why, requestTimeout=str, idleThreshold=int,
                 maxBusyScore=float, inFlightLoadProducerName=str)
        p.done()
        state.add(name, "inflight-scorer")

    return rule


def _session_affinity(state: State, name: str, p: Params) -> None:
    why = ("the session is the request's session header (x-session-id or an agent's); its home "
           "is the endpoint that served it last")
    if p.has("strategy"):
        strategy = p.get("strategy", str, "")
        check(strategy in ("encoded_endpoint_header", "session_id"), p.at("strategy"),
              "must be encoded_endpoint_header or session_id", strategy)
        state.notes.ignore(f"{p.at('strategy')} ({p.type})", why)
    p.ignore(why, encodedEndpointHeaderConfig=dict, sessionIdConfig=dict, profileName=str)
    p.done()
    state.add(name, "session-affinity-scorer")


# -- producers ------------------------------------------------------------------------------


def _approx_producer(state: State, name: str, p: Params) -> None:
    state.producers[name] = "approx-prefix-cache-producer"
    _index_sizing(state, p)
    p.done()


def _index_sizing(state: State, p: Params) -> None:
    """The approximate producer's sizing parameters, as ``prefixIndex`` settings."""
    auto = p.get("autoTune", bool, True)
    tokens_given = p.has("blockSizeTokens")
    tokens = p.get("blockSizeTokens", int, 0)
    check(auto or not tokens_given or tokens > 0, p.at("blockSizeTokens"),
          "must be > 0 when autoTune is false", tokens)
    # llm-d's deprecated size, in characters (hashBlockSize on the older scorer); tokens win.
    chars = p.get("blockSize", int, 0) or p.get("hashBlockSize", int, 0)
    index = state.section("prefixIndex")
    if tokens > 0:
        index["blockBytes"] = max(16, round(tokens * BYTES_PER_TOKEN))
    elif chars > 0:
        index["blockBytes"] = max(16, chars)
    block_tokens = index.get("blockBytes", DEFAULT_BLOCK_BYTES) / BYTES_PER_TOKEN
    max_tokens = p.get("maxPrefixTokensToMatch", int, 0)
    max_blocks = p.get("maxPrefixBlocksToMatch", int, 0)
    check(max_tokens >= 0, p.at("maxPrefixTokensToMatch"), "must be >= 0", max_tokens)
    if max_tokens > 0:
        index["maxBlocksPerRequest"] = max(1, math.ceil(max_tokens / block_tokens))
    elif max_blocks > 0:
        index["maxBlocksPerRequest"] = max_blocks
    capacity = p.get("lruCapacityPerServer", int, 0)
    if capacity > 0 and not auto:
        # llm-d counts entries of its own blocks: blockSizeTokens, or blockSize characters.
        llmd_block = tokens if tokens > 0 else chars / BYTES_PER_TOKEN if chars > 0 else 16
        index["capacityBlocks"] = max(1, round(capacity * llmd_block / block_tokens))
    elif capacity > 0:
        state.notes.ignore(f"{p.at('lruCapacityPerServer')} ({p.type})",
                           "with autoTune (llm-d's default) each endpoint's index is sized by "
                           "the KV capacity it reports; set autoTune: false to fix it")


# The burst producer's integer parameters: llm-d's default, its check, what it must be.
_BURST: dict[str, tuple[int, Callable[[int], bool], str]] = {
    "windowDurationMs": (100, lambda v: 0 < v <= 10_000, "must be in 1..10000"),
    "maxPerReplica": (-1, lambda v: v == -1 or v >= 1, "must be -1 (unlimited) or >= 1"),
    "blockSizeTokens": (64, lambda v: v > 0, "must be > 0"),
    "maxPrefixTokensToMatch": (0, lambda v: v >= 0, "must be >= 0"),
    "minColocateBlocks": (0, lambda v: v >= 0, "must be >= 0"),
    "maxBatchSize": (1000, lambda v: v == -1 or v >= 1, "must be -1 (unlimited) or >= 1"),
}


def _burst_producer(state: State, name: str, p: Params) -> None:
    """Checked as llm-d checks them, then ignored: the index already does what bursts need."""
    state.producers[name] = "burst-prefix-cache-producer"
    given = [key for key in (*_BURST, "balanceBy") if p.has(key)]
    values: dict[str, int] = {}
    for key, (default, ok, rule) in _BURST.items():
        values[key] = p.get(key, int, default)
        check(ok(values[key]), p.at(key), rule, values[key])
    limit, block = values["maxPrefixTokensToMatch"], values["blockSizeTokens"]
    check(limit == 0 or limit >= block, p.at("maxPrefixTokensToMatch"),
          f"must be 0 or >= blockSizeTokens ({block})", limit)
    balance = p.get("balanceBy", str, "requests")
    check(balance in ("", "requests", "tokens"), p.at("balanceBy"), "must be requests or tokens",
          balance)
    p.done()
    for key in given:
        state.notes.ignore(f"{p.at(key)} ({p.type})", "the prefix index records each pick at "
                           "once, so the later requests of a burst already find the first "
                           "one's prefix where it went")


def _precise_producer(state: State, name: str, p: Params) -> None:
    state.producers[name] = "precise-prefix-cache-producer"
    _precise_parameters(state, p)
    state.section("precisePrefix")["enabled"] = True


# llm-d-kv-cache's index settings (kvblock.IndexConfig); metricsLoggingInterval is a Go
# time.Duration, which JSON gives as nanoseconds.
_KV_BLOCK_INDEX = mapping(
    enableMetrics=bool, metricsLoggingInterval=int, inMemoryConfig=dict,
    costAwareMemoryConfig=dict, redisConfig=dict, valkeyConfig=dict,
)


def _precise_parameters(state: State, p: Params) -> None:
    precise = state.section("precisePrefix")
    tokens = p.sub("tokenProcessorConfig")
    in_tokens, legacy = tokens.get("blockSizeTokens", int, 0), tokens.get("blockSize", int, 0)
    for key, value in (("blockSizeTokens", in_tokens), ("blockSize", legacy)):
        check(value >= 0, tokens.at(key), "must be > 0 (or 0: llm-d's default)", value)
    size = in_tokens or legacy
    if size > 0:
        precise["blockSize"] = size
    tokens.ignore("block keys are prefixgate's own, computed from token ids; the engine's "
                  "hash settings are not needed", hashSeed=str, hashAlgorithm=str)
    tokens.done()
    events = p.sub("kvEventsConfig")
    kv = state.section("precisePrefix", "kvEvents")
    if events.has("topicFilter"):
        kv["topic"] = events.get("topicFilter", str, "")
    pods = events.sub("podDiscoveryConfig")
    for key, native in (("socketPort", "port"), ("replaySocketPort", "replayPort")):
        port = pods.get(key, int, 0)
        if port:
            kv[native] = port
    pods.ignore("endpoints come from pool.endpoints, --backend or discovery",
                podLabelSelector=str, podNamespace=str)
    pods.done()
    events.ignore("prefixgate subscribes to each endpoint's publisher (set "
                  "precisePrefix.kvEvents.port), it does not bind one socket for all",
                  zmqEndpoint=str)
    events.ignore("events are read on the event loop, per endpoint", concurrency=int,
                  discoverPods=bool, engineType=str)
    events.done()
    indexer = p.sub("indexerConfig")
    indexer.ignore("the index always exports its Prometheus metrics",
                   kvBlockIndexConfig=_KV_BLOCK_INDEX)
    indexer.ignore("the index lives in memory or in Redis (precisePrefix.index)",
                   tokenizersPoolConfig=dict, prefixStoreConfig=dict, kvCacheBackendConfigs=list)
    inner = _speculative(precise, indexer)  # where llm-d's samples put them
    indexer.done()
    outer = _speculative(precise, p)
    if inner and outer:
        raise ConfigError(f"{outer}: set twice, here and as {inner}; keep one")
    p.done()


def _speculative(precise: dict[str, Any], p: Params) -> str | None:
    """speculativeIndexing and speculativeTTL, at the top of the parameters (llm-d's plugin
    struct) or inside indexerConfig (where llm-d's samples put them; its Go decoding drops
    them there unread): the same native setting from either place. The TTL's path if set."""
    p.ignore("picks are always recorded speculatively until the events confirm them",
             speculativeIndexing=bool)
    if not p.has("speculativeTTL"):
        return None
    where = p.at("speculativeTTL")
    precise["speculativeTtlSeconds"] = duration_seconds(p.get("speculativeTTL", str, ""), where)
    return where


def _token_producer(state: State, name: str, p: Params) -> None:
    tokenizer = state.section("precisePrefix", "tokenizer")
    tokenizer["type"] = "remote"
    vllm = p.sub("vllm")
    if vllm.has("timeout"):
        timeout = duration_seconds(vllm.get("timeout", str, ""), vllm.at("timeout"))
        tokenizer["timeoutMs"] = timeout * 1000.0
    vllm.ignore("the prompt is tokenized by the endpoints' own POST /tokenize",
                url=str, mmTimeout=duration)
    vllm.done()
    p.ignore("the request's model is tokenized", modelName=str)
    p.ignore("the prompt is tokenized by the endpoints' own POST /tokenize",
             udsTokenizerConfig=dict, estimate=unknown)
    p.done()


def _noop(why: str) -> Rule:
    """Accepted with nothing to build (the gateway always does this); parameters logged."""

    def rule(state: State, name: str, p: Params) -> None:
        p.ignore_all(why)

    return rule


# Rules by llm-d type. Scorers that name a producer run after every other plugin.
RULES: dict[str, Rule] = {
    "decode-filter": _same("decode-filter"),
    "prefill-filter": _same("prefill-filter"),
    "queue-scorer": _same("queue-scorer"),
    "kv-cache-utilization-scorer": _same("kv-cache-utilization-scorer"),
    "load-aware-scorer": _load_aware,
    "no-hit-lru-scorer": _no_hit_lru,
    "prefix-cache-scorer": _prefix_scorer,
    "precise-prefix-cache-scorer": _precise_scorer,
    "session-affinity-scorer": _session_affinity,
    "active-request-scorer": _inflight("scored on the gateway's own count of requests in "
                                       "flight per endpoint (inflight-scorer)"),
    "running-requests-size-scorer": _inflight("scored on the gateway's own count of requests "
                                              "in flight per endpoint (inflight-scorer)"),
    "max-score-picker": _picker("max-score-picker"),
    "random-picker": _picker("random-picker"),
    "approx-prefix-cache-producer": _approx_producer,
    "burst-prefix-cache-producer": _burst_producer,
    "precise-prefix-cache-producer": _precise_producer,
    "token-producer": _token_producer,
    "tokenizer": _token_producer,
    "inflight-load-producer": _noop("the gateway always counts requests in flight"),
    "session-id-producer": _noop("the session id is read from the request's headers"),
    "core-metrics-extractor": _noop("vLLM's metric names are built in"),
    "endpoint-notification-source": _noop("endpoints come from pool.endpoints, --backend or "
                                          "discovery, and precise routing follows them"),
    "k8s-notification-source": _noop("endpoints come from pool.endpoints, --backend or "
                                     "discovery"),
    "models-data-source": _noop("each endpoint's models are read from its /v1/models"),
    "models-data-extractor": _noop("each endpoint's models are read from its /v1/models"),
    "openai-parser": _noop("OpenAI chat, completions and Responses are always served"),
    "anthropic-parser": _noop("Anthropic Messages is always served"),
    "vllmhttp-parser": _noop("vLLM's OpenAI-compatible API is always served"),
    "passthrough-parser": _noop("a body that is not parsed is refused with a 400"),
    **HANDLER_RULES,
    **FLOW_RULES,
}
LATE = frozenset({"prefix-cache-scorer", "no-hit-lru-scorer"})


def apply(state: State, name: str, plugin_type: str, p: Params) -> None:
    """Run the rule for ``plugin_type``; a refused or unknown type fails, naming it."""
    refused = REFUSED.get(plugin_type)
    if refused is not None:
        raise ConfigError(f"{p.where.rsplit('.', 1)[0]}.type: llm-d plugin {plugin_type!r} "
                          f"has no counterpart in prefixgate; {refused}")
    rule = RULES.get(plugin_type)
    if rule is None:
        known = ", ".join(sorted(RULES))
        raise ConfigError(f"{p.where.rsplit('.', 1)[0]}.type: unknown plugin type "
                          f"{plugin_type!r} (llm-d types accepted here: {known})")
    rule(state, name, p)
