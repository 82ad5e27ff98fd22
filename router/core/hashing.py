"""Block hashing: cut a rendered prompt into fixed-size blocks and hash them as a chain.

Block ``i``'s hash is ``xxh64(block_i, seed=hash_{i-1})`` and the chain's seed is the hash of the
model name, so a hash identifies the whole prefix up to and including its block, and two models
never share entries. Only full blocks are hashed, as vLLM does: a trailing partial block cannot
be reused until it is complete.

Blocks are measured in UTF-8 bytes. The default, 256 bytes, is about 64 tokens at the usual four
bytes per token of English and code: coarse enough that a 200K-token agent prompt is ~3,000
hashes (well under a millisecond to walk), fine enough that at most ~63 tokens of a match are lost
at the tail. llm-d moved to >= 64-token blocks for the same memory reason.
"""

from __future__ import annotations

import xxhash

DEFAULT_BLOCK_BYTES = 256
BYTES_PER_TOKEN = 4.0


def chain_seed(model: str) -> int:
    return xxhash.xxh64_intdigest(model.encode())


def block_hashes(
    text: str, block_bytes: int, model: str, max_blocks: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of ``text`` (at most ``max_blocks`` of them)."""
    return hash_blocks(text.encode("utf-8", "surrogatepass"), block_bytes, model, max_blocks)


def hash_blocks(
    encoded: bytes, block_bytes: int, model: str, max_blocks: int | None = None
) -> list[int]:
    """:func:`block_hashes` of text already encoded as UTF-8."""
    data = memoryview(encoded)
    full = len(data) // block_bytes
    if max_blocks is not None:
        full = min(full, max_blocks)
    digest = xxhash.xxh64_intdigest
    h = chain_seed(model)
    hashes = [0] * full
    for i in range(full):
        start = i * block_bytes
        h = digest(data[start : start + block_bytes], h)
        hashes[i] = h
    return hashes


def estimate_tokens(num_bytes: int, bytes_per_token: float = BYTES_PER_TOKEN) -> int:
    return max(1, round(num_bytes / bytes_per_token))
