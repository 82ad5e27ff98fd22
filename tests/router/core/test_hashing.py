from __future__ import annotations

import pytest

from router.core.hashing import block_hashes, chain_seed, estimate_tokens


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes("a" * 15, 16, "m") == []
    assert len(block_hashes("a" * 16, 16, "m")) == 1
    assert len(block_hashes("a" * 47, 16, "m")) == 2


def test_chain_is_prefix_stable() -> None:
    base = "system prompt " * 40
    grown = base + "user: next turn " * 10
    short, long = block_hashes(base, 16, "m"), block_hashes(grown, 16, "m")
    assert long[: len(short)] == short
    assert len(long) > len(short)


def test_hash_depends_on_whole_prefix() -> None:
    a = block_hashes("x" * 16 + "y" * 16, 16, "m")
    b = block_hashes("z" * 16 + "y" * 16, 16, "m")
    assert a[1] != b[1], "the same block after a different prefix must hash differently"


def test_model_seeds_the_chain() -> None:
    assert block_hashes("a" * 32, 16, "m1") != block_hashes("a" * 32, 16, "m2")
    assert chain_seed("m1") != chain_seed("m2")


def test_deterministic_and_bounded() -> None:
    text = "héllo wörld " * 100
    assert block_hashes(text, 64, "m") == block_hashes(text, 64, "m")
    assert len(block_hashes(text, 16, "m", max_blocks=5)) == 5


@pytest.mark.parametrize(("size", "tokens"), [(0, 1), (4, 1), (400, 100), (1_000_000, 250_000)])
def test_estimate_tokens(size: int, tokens: int) -> None:
    assert estimate_tokens(size) == tokens
