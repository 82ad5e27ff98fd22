"""The gateway's own block keys for precise prefix routing.

Engine block hashes cannot be reproduced by the gateway (vLLM hashes with sha256 of a pickle, a
per-process seed, extra keys), so both sides of the precise index speak in these keys instead:
the KV-event side computes them from each stored block's token ids and its parent's key, the
request side from the request's tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

KEY_SEED = 0x7072_6566_6978_6761  # "prefixga": distinct from any engine's seed


def block_keys(
    tokens: Sequence[int], block_size: int, parent: int = KEY_SEED, max_blocks: int | None = None
) -> list[int]:
    """Chained keys of the full blocks of ``tokens``: ``xxh64(uint32 ids, seed=parent key)``."""
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    if full <= 0:
        return []
    raw = _id_bytes(tokens[: full * block_size])
    step = len(raw) // full
    digest = xxhash.xxh64_intdigest
    keys = [0] * full
    for i in range(full):
        parent = digest(raw[i * step : (i + 1) * step], parent)
        keys[i] = parent
    return keys


def _id_bytes(ids: Sequence[int]) -> bytes:
    # A memo's 32-bit ids are the bytes already (router/precise/segments.py); a list is converted.
    if isinstance(ids, array) and ids.typecode == "I":
        return ids.tobytes()
    try:
        return array("I", ids).tobytes()
    except OverflowError:  # an id past 2**32 (no tokenizer has one); keep it exact anyway
        return array("q", ids).tobytes()
