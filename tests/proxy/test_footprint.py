"""proxy/scheduler/footprint.py's block tables against their spec, block by block, on random histories
at agent sizes (3K blocks): `PrefixIndex`'s counts, and `RecentPrefixes`, whose `cached_prefix` finds
runs of held and of recently freed blocks in C and checks a run's freshness once per release, held to
the plain per-block loop it replaced (kept here as the reference), stale and held blocks interleaved."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from proxy.scheduler.footprint import PrefixIndex, RecentPrefixes

pytestmark = pytest.mark.unit


def chain(n: int, tag: int) -> list[bytes]:
    return [b"%d:%d" % (tag, i) for i in range(n)]


def ref_cached_prefix(hashes: list[bytes], start: int, refs: dict[bytes, int],
                      recent: OrderedDict[bytes, tuple[float, int]], ttl_s: float, admitted: int, now: float) -> int:
    """The spec: block by block from `start`, a hit while held or recently freed and still fresh."""
    n = start
    while n < len(hashes):
        h = hashes[n]
        if h not in refs:
            seen = recent.get(h)
            if seen is None or now - seen[0] > ttl_s or admitted >= seen[1]:
                break
        n += 1
    return n


def test_prefix_index_counts_as_the_plain_loops_do() -> None:
    rng = random.Random(7)
    idx, refs = PrefixIndex(), {}  # refs: the spec's table
    held: list[list[bytes]] = []
    for step in range(400):
        if held and rng.random() < 0.4:
            hs = held.pop(rng.randrange(len(held)))
            freed = sum(1 for h in hs if refs[h] == 1)
            for h in hs:
                refs[h] -= 1
                if not refs[h]:
                    del refs[h]
            assert idx.release(hs) == freed
        else:
            hs = chain(rng.randrange(0, 3000), rng.randrange(6))[rng.randrange(0, 50):]
            if rng.random() < 0.5:
                for h in hs:
                    refs[h] = refs.get(h, 0) + 1
                idx.take(hs)
            else:
                new = [h for h in hs if h not in refs]
                for h in new:
                    refs[h] = 1
                assert idx.materialize(hs) == new
                hs = new
            held.append(hs)
        probe = chain(rng.randrange(0, 3000), rng.randrange(6))
        assert idx.held(probe) == sum(1 for h in probe if h in refs)
        lead = 0
        while lead < len(probe) and probe[lead] in refs:
            lead += 1
        assert idx.shared_prefix(probe) == lead
        assert len(idx) == len(refs) and all(h in idx for h in list(refs)[:20]), step
    with pytest.raises(KeyError):  # a block nobody holds: the caller's bug, not a silent count
        idx.acquire([b"never taken"])


def test_recent_prefixes_hit_and_order_as_the_plain_loop_does() -> None:
    rng = random.Random(11)
    ttl = 5.0
    recent, spec = RecentPrefixes(capacity=6000, ttl_s=ttl), OrderedDict()
    idx = PrefixIndex()
    now, admitted = 0.0, 0
    for step in range(300):
        now += rng.choice((0.1, 0.5, 2.0))
        admitted += rng.randrange(0, 400)
        hs = chain(rng.randrange(1, 3000), rng.randrange(4))[: rng.randrange(1, 3000)]
        what = rng.random()
        if what < 0.45:  # a request ends: its blocks freed, stamped alike
            mark = admitted + rng.randrange(0, 2000)
            for h in hs:
                spec[h] = (now, mark)
                spec.move_to_end(h)
            while len(spec) > recent.capacity:
                spec.popitem(last=False)
            recent.add(hs, mark, now=now)
            assert list(recent._seen.items()) == list(spec.items())
        elif what < 0.6:  # a running request holds some blocks (a hit even where their stamp went stale)
            idx.take(hs[rng.randrange(len(hs)):])
        probe = chain(rng.randrange(1, 3000), rng.randrange(4))
        start = idx.shared_prefix(probe)
        want = ref_cached_prefix(probe, start, idx._refs, spec, ttl, admitted, now)
        assert recent.cached_prefix(probe, start, idx, admitted, now=now) == want, step
