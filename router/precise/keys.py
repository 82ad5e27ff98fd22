"""The gateway's own block keys for precise prefix routing.

Engine block hashes cannot be reproduced by the gateway (vLLM hashes with sha256 of a pickle, a
per-process seed, extra keys), so both sides of the precise index speak in these keys instead:
the KV-event side computes them from each stored block's token ids and its parent's key, the
request side from the request's tokens.

vLLM hashes a block with its *extra keys* too (``generate_block_hash_extra_keys``): the LoRA
adapter's name on every block, multimodal identifiers on the blocks an input overlaps, and the
request's ``cache_salt`` on the first block only. Two blocks with the same tokens but other
extra keys are other cache entries, so a key folds them in as well: a block's extra keys,
encoded (:func:`encode_extra`), are hashed into its key, which every later key of the chain
then depends on. Blocks without extra keys keep the plain token key.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash

KEY_SEED = 0x7072_6566_6978_6761  # "prefixga": distinct from any engine's seed

# Per block, its encoded extra keys (None: none), as :func:`block_keys` folds them in.
BlockExtras = Sequence[bytes | None]


def encode_extra(extra: Sequence[Any]) -> bytes:
    """One block's extra keys, in vLLM's order, as bytes; msgpack because the event side
    receives them as msgpack values (strings, ints, bytes, nested arrays) and this packing of
    those is deterministic, so both sides encode the same extra keys alike."""
    packed: bytes = msgpack.packb(list(extra), use_bin_type=True)
    return packed


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    parent: int = KEY_SEED,
    max_blocks: int | None = None,
    extras: BlockExtras | None = None,
) -> list[int]:
    """Chained keys of the full blocks of ``tokens``: ``xxh64(uint32 ids, seed=parent key)``,
    rehashed with ``extras[i]`` as ``xxh64(extra, seed=that)`` for a block that has any."""
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    if full <= 0:
        return []
    raw = _id_bytes(tokens[: full * block_size])
    step = len(raw) // full
    digest = xxhash.xxh64_intdigest
    keys = [0] * full
    if extras is None:
        for i in range(full):
            parent = digest(raw[i * step : (i + 1) * step], parent)
            keys[i] = parent
        return keys
    for i in range(full):
        parent = digest(raw[i * step : (i + 1) * step], parent)
        extra = extras[i] if i < len(extras) else None
        if extra is not None:
            parent = digest(extra, parent)
        keys[i] = parent
    return keys


def request_extras(
    blocks: int, lora_name: str | None, cache_salt: str | None
) -> list[bytes | None] | None:
    """A text prompt's extra keys per block, as vLLM builds them: the adapter's name on every
    block, then the salt on the first; None when the request has neither."""
    if blocks <= 0 or (lora_name is None and cache_salt is None):
        return None
    lora = [] if lora_name is None else [lora_name]
    salt = [] if cache_salt is None else [cache_salt]
    rest = encode_extra(lora) if lora else None
    return [encode_extra(lora + salt), *([rest] * (blocks - 1))]


def request_keys(
    tokens: Sequence[int],
    block_size: int,
    max_blocks: int | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """:func:`block_keys` of a request's prompt, with its adapter and salt folded in."""
    blocks = len(tokens) // block_size
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    extras = request_extras(blocks, lora_name, cache_salt)
    return block_keys(tokens, block_size, max_blocks=max_blocks, extras=extras)


def _id_bytes(ids: Sequence[int]) -> bytes:
    # A memo's 32-bit ids are the bytes already (router/precise/segments.py); a list is converted.
    if isinstance(ids, array) and ids.typecode == "I":
        return ids.tobytes()
    try:
        return array("I", ids).tobytes()
    except OverflowError:  # an id past 2**32 (no tokenizer has one); keep it exact anyway
        return array("q", ids).tobytes()
