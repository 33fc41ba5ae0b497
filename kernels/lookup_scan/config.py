"""Launch configuration of the lookup scan: the per-(B, S) rule the launcher reads.

Pure Python (no Triton), product code: triton.py's launcher, the bench, diag.py and the tests read
the same table.  Every number in the comments is an H200 measurement recorded in NOTES.md (the
rule's table of record) or HISTORY.md (how each choice was made).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Launch:
    """One launch configuration: the tile and the kernel's code paths.

    A tile is ``block_tokens`` = 32 * warps * g rows of 4 * nv tokens; the first tile of every
    program is read before the length is known, so cap * tile tokens bound what a launch reads of
    a buffer whose rows are mostly empty.  ``order``: the tile's loads issued before the length's
    (a barrier between them).  ``rowkey``: row-local scoring keys (XOR-OR tests at MIN_N ==
    MAX_N).  ``hit_n``: the tile's hit test on the first MIN_N tokens instead of the last one.
    ``poll_max_p``: the polling fold (per-program slots, the last program polls them) up to this
    many programs per request, tickets above.  ``words`` / ``direct``: on the ticket path, the
    draft rides with the max (k <= 8), and the fold goes into the outputs themselves (positions
    < 2**22); tests turn them off to reach the paths the launcher takes at k > 8 / S >= 2**22.
    """

    nv: int
    g: int
    warps: int
    cap: int
    order: bool = False
    rowkey: bool = False
    hit_n: bool = False
    poll_max_p: int = 256
    words: bool = True
    direct: bool = True

    def with_(self, **kw: object) -> Launch:
        return replace(self, **kw)  # type: ignore[arg-type]


# Tiers by work W = B * S (both fixed when a graph is captured, so the choice is one launch of one
# config).  Tiles from the H200 sweep of 2126580 (every tile on all 32 bench rows, two passes, rule
# in d8b4f52); switches from the candidate calls of sessions 4-12 (c5 -> c12 -> c19 -> c20).
RULE: tuple[tuple[int, Launch], ...] = (
    # W <= 32K (8K/32K B1): one-warp programs of 128 tokens: no block barrier in the reductions and
    # <= 256 programs; 8K B1 n6-12 2.98 / 2.90 µs (was 3.81 / 3.80), 32K B1 3.09 / 3.00 (3.92 / 3.82).
    (1 << 15, Launch(1, 1, 1, 8192)),
    # W <= 128K (8K B8, 100K B1): one-warp programs of 256 tokens (128-token ones pass 500 programs
    # and lose: 100K B1 n5-5 quote 1.13x); 100K B1 n6-12 3.30 / 3.26 (3.91 / 3.94) at the time.
    (1 << 17, Launch(2, 1, 1, 4096)),
    # W <= 1M (256K B1, 32K B8, 100K B8): 1024-token tiles of 4 warps, ORDER (geometric mean 3-8%
    # off n6-12 rows on 4-warp tiles), row-local keys + the MIN_N-token hit test (c4 / c5, session
    # 4: all rows <= 1.03x c1, 256K B8 n5-5 6.39 / 6.76 µs vs 6.71 / 7.81).
    (1 << 20, Launch(2, 1, 4, 2048, order=True, rowkey=True, hit_n=True)),
)
# Past 1M (256K B8): 2048-token tiles, 16 contiguous tokens per thread, the MIN_N-token hit test
# (c5); no tile beats it on all four rows (256-token one-warp 0.93x on n6-12 vocab 8 but 1.13-1.20x
# on quoting; ORDER 1.00-1.07x).
LARGE = Launch(4, 1, 4, 1024, hit_n=True)
# ... and at 1 <= max_n <= 5 (a one-vector halo) 4-token rows (a warp's load covers 512 contiguous
# bytes) with row-local keys: sweep 2's pick for row b (256K B8 n5-5 6.41 / 6.70 µs, 0.500 of vLLM).
LARGE_SHORT = Launch(1, 4, 4, 1024, rowkey=True, hit_n=True)


def block_tokens(launch: Launch) -> int:
    """Tokens per tile: 32 * warps * g rows of 4 * nv tokens."""
    return 4 * launch.nv * launch.g * 32 * launch.warps


def workspace_numel(batch: int) -> int:
    """int64 elements of the workspace for B requests: one 128-byte line per request, then one
    int32 slot per program (polling fold: B * P <= max(8192, 8 B) for every RULE tier,
    P = min(tiles, max(8, cap // B))).  Callers allocate zeros of this size once and reuse them;
    the kernel leaves them zero."""
    return 16 * batch + max(8192, 8 * batch) // 2


def default_launch(batch: int, capacity: int, max_n: int = 0) -> Launch:
    """The rule's launch for B requests over an [*, S] history buffer (max_n: the longest n-gram)."""
    work = batch * capacity
    for limit, launch in RULE:
        if work <= limit:
            return launch
    return LARGE_SHORT if 1 <= max_n <= 5 else LARGE
