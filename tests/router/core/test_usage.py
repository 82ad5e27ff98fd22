"""Token counts read from the usage of each API's answers."""

from __future__ import annotations

from router.core.usage import answer_tokens, cached_tokens, prompt_tokens


def test_prompt_tokens_reads_openai_usage() -> None:
    assert prompt_tokens({"prompt_tokens": 12, "completion_tokens": 3}) == 12
    assert prompt_tokens({"prompt_tokens": 0}) is None
    assert prompt_tokens({"prompt_tokens": True}) is None
    assert prompt_tokens({"prompt_tokens": -3}) is None
    assert prompt_tokens(None) is None
    assert prompt_tokens({"output_tokens": 2}) is None  # an Anthropic message_delta


def test_prompt_tokens_of_responses_usage_is_input_tokens_cached_or_not() -> None:
    usage = {"input_tokens": 577, "input_tokens_details": {"cached_tokens": 576}}
    assert prompt_tokens(usage) == 577
    assert cached_tokens(usage) == 576


def test_anthropic_input_tokens_leave_out_the_cache_so_the_prompt_adds_it_back() -> None:
    usage = {
        "input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 576,
    }
    assert prompt_tokens(usage) == 577
    assert cached_tokens(usage) == 576
    written = {"input_tokens": 10, "cache_creation_input_tokens": 500}
    assert prompt_tokens(written) == 510
    # An engine that reports no cache fields counts the whole prompt in input_tokens.
    assert prompt_tokens({"input_tokens": 7, "output_tokens": 1}) == 7
    assert cached_tokens({"input_tokens": 7}) is None


def test_cached_tokens_reads_openai_details() -> None:
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}) == 8
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": None}) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": "8"}}) is None


def test_answer_tokens_reads_completion_tokens_or_output_tokens() -> None:
    assert answer_tokens({"prompt_tokens": 10, "completion_tokens": 7}) == 7
    assert answer_tokens({"input_tokens": 10, "output_tokens": 5}) == 5  # Responses, Messages
    assert answer_tokens({"completion_tokens": 0}) == 0
    for odd in (None, {}, {"completion_tokens": -1}, {"completion_tokens": True}, []):
        assert answer_tokens(odd) is None  # type: ignore[arg-type]
