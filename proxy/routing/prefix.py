"""What an engine was sent for a session, as chained block hashes: hash i covers tokens [0, (i+1)*B), so
the number of equal leading hashes is the exact token-prefix overlap in blocks, and a record stays small
(8 bytes per block) however long the session grows."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST = 8


def block_hashes(ids: Sequence[int], block: int, known: bytes = b"") -> bytes:
    """The chain hashes of every full block of `ids` (a partial last block is not cached by engines).
    `known`: the chain of a prefix of `ids` already hashed (a turn's prompt, when its reply is added)."""
    data = ids.tobytes() if isinstance(ids, array) and ids.itemsize == 4 else array("I", ids).tobytes()
    step = block * 4
    out = bytearray(known)
    prev = known[-DIGEST:]
    for start in range(len(known) // DIGEST * step, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[start : start + step], digest_size=DIGEST).digest()
        out += prev
    return bytes(out)


def overlap_blocks(a: bytes, b: bytes) -> int:
    """Leading blocks two chains share (chained: the first difference ends the shared prefix)."""
    n = min(len(a), len(b)) // DIGEST
    lo, hi = 0, n  # equality is monotone along a chain, so bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        end = mid * DIGEST
        if a[end - DIGEST : end] == b[end - DIGEST : end]:
            lo = mid
        else:
            hi = mid - 1
    return lo
