"""Parsing a vLLM replica's pages: the series a router needs, whatever the release."""

from __future__ import annotations

from router.pool.engine_pages import parse_vllm_metrics

PAGE = """\
# HELP vllm:num_requests_waiting Requests waiting.
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="lora-b"} 2.0
vllm:num_requests_running{model_name="a"} 7
vllm:gpu_cache_usage_perc{model_name="a"} 0.9
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:prefix_cache_hits_total{model_name="a"} 120.0
vllm:prefix_cache_queries_total{model_name="a"} 400.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048.0",model_name="a"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 5.0
"""


def test_parse_sums_label_sets_and_prefers_the_current_kv_name() -> None:
    m = parse_vllm_metrics(PAGE, 12.0)
    assert (m.waiting, m.running) == (5.0, 7.0)
    assert m.kv_usage == 0.25, "kv_cache_usage_perc wins over the deprecated gpu_cache name"
    assert (m.prefix_hits, m.prefix_queries) == (120.0, 400.0)
    assert (m.block_size, m.num_gpu_blocks, m.scraped_at) == (16, 2048, 12.0)


def test_parse_reads_the_deprecated_kv_name_alone() -> None:
    old_vllm = "vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.4\n"
    assert parse_vllm_metrics(old_vllm, 0).kv_usage == 0.4


def test_parse_tolerates_garbage() -> None:
    m = parse_vllm_metrics("vllm:num_requests_waiting nan-ish\nvllm:kv_cache_usage_perc 7\n", 0)
    assert m.waiting == 0.0 and m.kv_usage == 1.0  # clamped to [0, 1]
    assert m.block_size is None and m.num_gpu_blocks is None


def test_parse_skips_values_that_are_not_finite() -> None:
    page = "vllm:num_requests_running 2\nvllm:num_requests_running{x=\"b\"} NaN\n"
    page += "vllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc NaN\n"
    m = parse_vllm_metrics(page, 0)
    assert (m.running, m.waiting, m.kv_usage) == (2.0, 0.0, 0.0)


def test_parse_takes_the_mean_kv_use_of_a_data_parallel_servers_engines() -> None:
    page = "".join(
        f'vllm:kv_cache_usage_perc{{engine="{e}"}} 0.6\n'
        f'vllm:num_requests_running{{engine="{e}"}} 3\n'
        for e in (0, 1)
    )
    m = parse_vllm_metrics(page, 0)
    assert m.kv_usage == 0.6, "a share, not a count: two engines 60% full are 60% full"
    assert m.running == 6.0


def test_parse_reads_the_prefix_counters_of_older_vllm() -> None:
    """vLLM before 0.9.2 named them vllm:gpu_prefix_cache_* (the same releases whose KV use
    is read from the deprecated gpu_cache_usage_perc): without them a restart goes unseen."""
    old_vllm = (
        'vllm:gpu_cache_usage_perc{model_name="a",engine="0"} 0.4\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="a",engine="0"} 400.0\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="a",engine="0"} 120.0\n'
    )
    m = parse_vllm_metrics(old_vllm, 0)
    assert (m.prefix_hits, m.prefix_queries) == (120.0, 400.0)
    both = old_vllm + (  # 0.9.2 to 0.10 export both names, with the same counts
        'vllm:prefix_cache_queries_total{model_name="a",engine="0"} 400.0\n'
        'vllm:prefix_cache_hits_total{model_name="a",engine="0"} 120.0\n'
    )
    m = parse_vllm_metrics(both, 0)
    assert (m.prefix_hits, m.prefix_queries) == (120.0, 400.0), "counted once"


def test_parse_survives_a_cache_config_label_that_is_not_a_finite_number() -> None:
    page = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="inf"} 1.0\n'
        'vllm:num_requests_waiting{model_name="a"} 2\n'
    )
    m = parse_vllm_metrics(page, 0)
    assert (m.block_size, m.num_gpu_blocks, m.waiting) == (16, None, 2.0)


def test_parse_reads_when_the_engine_started() -> None:
    """The engine's life, which every gateway reads alike: gateways that notice the same
    restart clear the shared index once for it. The prefix-query counter's creation time
    (the latest of a data-parallel server's engines), else the process start, else unknown."""
    created = (
        'vllm:prefix_cache_queries_total{model_name="a",engine="0"} 10.0\n'
        'vllm:prefix_cache_queries_created{model_name="a",engine="0"} 1.7000000002e+09\n'
        'vllm:prefix_cache_queries_created{model_name="a",engine="1"} 1.7000000005e+09\n'
        "process_start_time_seconds 1.69999999e+09\n"
    )
    assert parse_vllm_metrics(created, 0).engine_started == 1.7000000005e09
    older = (
        'vllm:gpu_prefix_cache_queries_created{model_name="a",engine="0"} 1.6e+09\n'
        "process_start_time_seconds 1.5e+09\n"
    )
    assert parse_vllm_metrics(older, 0).engine_started == 1.6e09
    assert parse_vllm_metrics("process_start_time_seconds 1.5e+09\n", 0).engine_started == 1.5e09
    unknown = parse_vllm_metrics('vllm:num_requests_waiting{model_name="a"} 2\n', 0)
    assert unknown.engine_started == 0
