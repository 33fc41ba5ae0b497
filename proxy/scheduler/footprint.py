"""A request's worst case in engine blocks, and the prompt prefixes running requests hold in common.

Worst case: prompt + capped `max_tokens` (+ speculative lookahead) rounded up to blocks in every
attention group, plus the seat's GDN state pages on hybrid models. That is what vLLM may come to hold
for the request before it ends; admitting only while the sum fits is what keeps it from preempting.

Shared prefixes: vLLM allocates a block once for every running request whose prompt starts with the
same full blocks, but only once the first holder has *computed* them (two prompts scheduled in the
same step both miss and both allocate). So a prefix is counted once only after its holder has produced
a token (`PrefixIndex.materialize`), and a request admitted before that holds its own copy. Blocks of a
finished request that sit in vLLM's prefix cache are free-and-evictable in vLLM's accounting: a later
hit on them consumes free blocks exactly like a miss, so they earn no discount here.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence

from proxy.admission import Footprint

from .pool import PoolGeometry

# Prefix hashes are taken per granule of at least this many tokens (a multiple of the block): a 100K
# prompt then costs ~400 hashes, and rounding down to a granule only over-counts (the safe side).
MIN_GRANULE_TOKENS = 256


def granule_tokens(geom: PoolGeometry) -> int:
    return geom.block_size * math.ceil(MIN_GRANULE_TOKENS / geom.block_size)


def prefix_hashes(prompt: Sequence[int], granule: int) -> list[bytes]:
    """Chained hashes of the prompt's full granules that vLLM could serve from cache. vLLM always
    computes the last prompt token, so a granule that reaches it is not shareable."""
    if not prompt:
        return []
    raw = (prompt if isinstance(prompt, array) and prompt.typecode == "I" else array("I", prompt)).tobytes()
    step = granule * 4
    out: list[bytes] = []
    prev = b""
    for i in range((len(prompt) - 1) // granule):
        prev = hashlib.blake2b(prev + raw[i * step : (i + 1) * step], digest_size=12).digest()
        out.append(prev)
    return out


def worst_case_blocks(foot: Footprint, geom: PoolGeometry) -> int:
    tokens = foot.prompt_tokens + max(0, foot.max_tokens) + geom.spec_tokens
    return geom.token_blocks(tokens) + geom.state_blocks_per_seat


class PrefixIndex:
    """Granules of prompt prefix held by running requests, each counted once, refcounted.

    Owns only the shared-granule table; tickets own their private block counts.
    """

    def __init__(self) -> None:
        self._refs: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def shared_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading granules of `hashes` are already materialized by a running request."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._refs[h] += 1

    def materialize(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Enter a holder's granules; returns those that are new (now counted here, not privately)."""
        new = [h for h in hashes if h not in self._refs]
        for h in new:
            self._refs[h] = 1
        return new

    def release(self, hashes: Sequence[bytes]) -> int:
        """Drop one reference each; returns how many granules fell to zero (their blocks are free)."""
        freed = 0
        for h in hashes:
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                freed += 1
        return freed
