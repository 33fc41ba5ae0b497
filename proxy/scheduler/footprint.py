"""A request's worst case in engine blocks, and the prompt prefixes the engine holds in common.

Worst case: prompt + capped `max_tokens` (+ speculative lookahead) rounded up to blocks in every
attention group, plus the seat's GDN state pages on hybrid models. That is what vLLM may come to hold
for the request before it ends; admitting only while the sum fits is what keeps it from preempting.

Shared prefixes, block by block, the way vLLM's prefix cache finds them: a chain of hashes over the
prompt's full blocks (the block that holds the last prompt token is never a hit: vLLM always computes
it). vLLM allocates a block once for every running request whose prompt starts with the same full
blocks, but only once some holder has *computed* them:
- a running request's prompt blocks count once after it produced a token (`PrefixIndex.materialize`);
  two prompts scheduled in the same step both miss and both allocate, so one admitted before that
  holds its own copy;
- blocks of a request that finished moments ago still sit in vLLM's cache (free but hashed, evicted
  only when the free queue reaches them): a request that starts with them hits at once, so they are
  counted once from its admission (`RecentPrefixes`), and later requests share them too. vLLM appends
  freed blocks to the tail of its free queue and takes new ones from the head, so they outlive at least
  as many allocations as the pool had free when they were freed; the proxy trusts them only until it
  has admitted that many blocks since (and for at most `ttl_s`, for traffic it does not see). They earn no
  discount for the first request that re-uses them (a hit on a free block takes it out of the free
  pool exactly like a miss); the saving is that its followers do not pay for them again.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import takewhile

from proxy.admission import Footprint

from .pool import PoolGeometry


def prefix_hashes(prompt: Sequence[int], block: int, start: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of the prompt's full blocks that vLLM could serve from cache (all but the one
    holding the last token). ~6K blake2b calls for a 100K prompt in 16-token blocks: a few ms.
    `start`: the chain of a prompt this one is known to begin with (`PromptChains`), not hashed again."""
    if not prompt or block <= 0:
        return []
    full = (len(prompt) - 1) // block
    out = list(start[:full])
    if len(out) == full:
        return out
    first = len(out) * block
    part = prompt[first : full * block]
    raw = (part if isinstance(part, array) and part.typecode == "I" else array("I", part)).tobytes()
    step = block * 4
    prev = out[-1] if out else b""
    for i in range(0, len(raw), step):
        prev = hashlib.blake2b(prev + raw[i : i + step], digest_size=12).digest()
        out.append(prev)
    return out


class PromptChains:
    """The last prompt hashed per session with its chain, so a turn that extends it hashes only its
    new blocks: an agent's prompts are append-only (each turn is the last transcript plus new
    messages), and hashing a 30K-token prompt in 16-token blocks costs ~3 ms a turn, a 100K one ~9.
    Checked, not trusted: the blocks reused are those the two prompts begin with (compared as ids).
    Holds references to the prompts (no copies: a prompt is never changed once planned, each turn's
    is a new array); the least recently hashed go past `max_tokens` or `max_sessions`."""

    def __init__(self, max_tokens: int = 4_000_000, max_sessions: int = 1024) -> None:
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions
        self._chains: OrderedDict[str, tuple[Sequence[int], int, list[bytes]]] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._chains)

    def hashes(self, session: str, prompt: Sequence[int], block: int) -> list[bytes]:
        old = self._chains.pop(session, None)
        reuse: list[bytes] = []
        if old is not None:
            self._tokens -= len(old[0])
            ids, old_block, chain = old
            if old_block == block and chain:
                reuse = chain[:_common_blocks(ids, prompt, len(chain), block)]
        chain = prefix_hashes(prompt, block, reuse)
        self._chains[session] = (prompt, block, chain)
        self._tokens += len(prompt)
        while (self._tokens > self.max_tokens or len(self._chains) > self.max_sessions) and self._chains:
            dropped, _, _ = self._chains.popitem(last=False)[1]
            self._tokens -= len(dropped)
        return chain


def _common_blocks(a: Sequence[int], b: Sequence[int], limit: int, block: int) -> int:
    """How many whole blocks (at most `limit`) `a` and `b` both begin with: one comparison when `b`
    extends `a`, a binary search when they part."""
    n = min(limit, len(b) // block)
    if a[: n * block] == b[: n * block]:
        return n
    lo, hi = 0, n  # a and b agree on lo blocks and differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * block] == b[: mid * block]:
            lo = mid
        else:
            hi = mid
    return lo


def worst_case_blocks(foot: Footprint, geom: PoolGeometry) -> int:
    tokens = foot.prompt_tokens + max(0, foot.max_tokens) + geom.spec_tokens
    return geom.token_blocks(tokens) + geom.state_blocks_per_seat


class PrefixIndex:
    """Prompt blocks held by running requests, each counted once, refcounted.

    Owns only the shared-block table; tickets own their private block counts.
    """

    def __init__(self) -> None:
        self._refs: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, h: bytes) -> bool:
        return h in self._refs

    def held(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` are held (one loop here, not a method call per block)."""
        refs = self._refs
        return sum(1 for h in hashes if h in refs)

    def take(self, hashes: Sequence[bytes]) -> None:
        """One more reference to each: held ones gain one, the others are entered (`acquire` or
        `materialize` block by block, in one loop)."""
        refs = self._refs
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1

    def shared_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are already materialized by a running request."""
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
        """Enter a holder's blocks; returns those that are new (now counted here, not privately)."""
        new = [h for h in hashes if h not in self._refs]
        for h in new:
            self._refs[h] = 1
        return new

    def release(self, hashes: Sequence[bytes]) -> int:
        """Drop one reference each; returns how many blocks fell to zero (their blocks are free)."""
        freed = 0
        for h in hashes:
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                freed += 1
        return freed


class RecentPrefixes:
    """Computed prompt blocks of requests that ended, as vLLM's cache still holds them: at most
    `capacity` blocks (the pool), for at most `ttl_s` (after that other traffic may have evicted them)."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._seen: OrderedDict[bytes, tuple[float, int]] = OrderedDict()  # -> (freed at, evicted after)

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, hashes: Iterable[bytes], evicted_after: int, now: float | None = None) -> None:
        """Blocks just freed; they stay cached until the admitted-blocks count passes `evicted_after`."""
        now = time.monotonic() if now is None else now
        for h in hashes:
            self._seen[h] = (now, evicted_after)
            self._seen.move_to_end(h)
        while len(self._seen) > max(0, self.capacity):
            self._seen.popitem(last=False)

    def cached_prefix(self, hashes: Sequence[bytes], start: int, held: PrefixIndex, admitted: int,
                      now: float | None = None) -> int:
        """How many blocks from `start` on are a hit: held by a running request or recently freed (while
        `admitted`, the blocks admitted so far, has not reached their eviction mark). By runs: the held
        ones, then the recently freed ones, each run found in C; a run's freshness is checked once per
        release it came from, block by block only where one of them has gone stale."""
        now = time.monotonic() if now is None else now
        refs, recent, n, end = held._refs, self._seen, start, len(hashes)
        while n < end:
            n += _run(refs, hashes, n)
            tail = hashes[n : n + _run(recent, hashes, n)]
            if not tail:
                break
            stale = {s for s in set(map(recent.__getitem__, tail)) if now - s[0] > self.ttl_s or admitted >= s[1]}
            if not stale:
                n += len(tail)
                continue
            for h in tail:  # a stale block ends the hit unless a running request holds it
                if h not in refs and recent[h] in stale:
                    return n
                n += 1
        return n


def _run(keys: Container[bytes], hashes: Sequence[bytes], start: int = 0) -> int:
    """How many of `hashes[start:]`, from the first, are in `keys` (a C loop: takewhile into the
    dict's own `__contains__`, ~2x the plain loop's speed at an agent's 3K blocks)."""
    return len(list(takewhile(keys.__contains__, hashes[start:] if start else hashes)))
