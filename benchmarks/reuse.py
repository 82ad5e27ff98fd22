"""The reuse a workload offers: prompt tokens an infinitely large prefix cache would hold.

For each request, in arrival order, the reusable tokens are the leading full blocks of its
prompt that an earlier request's prompt or prompt + answer already contained (same session or a
shared prefix), capped like vLLM at ``prompt_tokens - 1``; of an answer, its last token does not
count (a replica samples it but never feeds it back, so never computes it). A router's captured
share is then ``cached tokens reported by the replicas / reusable tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def _chain(ids: Sequence[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = b"".join(i.to_bytes(4, "little") for i in ids[start : start + block_size])
        h = xxhash.xxh64_intdigest(block, h)
        hashes.append(h)
    return hashes


class ReuseTracker:
    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.reusable_tokens = 0

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """Reusable tokens of a prompt arriving now (does not record it)."""
        cap = (len(prompt_ids) - 1) // self.block_size
        run = 0
        for h in _chain(prompt_ids, self.block_size)[:cap]:
            if h not in self._seen:
                break
            run += 1
        return run * self.block_size

    def observe(self, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> int:
        """Count a request's prompt and its reusable part, then remember prompt and answer
        (but the answer's last token: sampled, never fed back, it is never computed)."""
        reusable = self.reusable(prompt_ids)
        self.prompt_tokens += len(prompt_ids)
        self.reusable_tokens += reusable
        self._seen.update(_chain([*prompt_ids, *output_ids[:-1]], self.block_size))
        return reusable

    @property
    def reusable_fraction(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
