"""Launch configuration of the lookup scan: tile configs, the per-(B, S) rule, named candidates.

Pure Python (no Triton): the launcher (triton.py), the bench / prof tools and the tests read the
same tables.  Every number in the comments is an H200 measurement recorded in NOTES.md.
"""

from __future__ import annotations

from typing import Any

# Config = (NV vectors of 4 tokens per row, G rows per thread, warps, programs-per-launch cap, FENCE,
# ORDER).  A tile is block_tokens(config) tokens; the first tile of every program is read before the
# length is known, so cap * tile tokens bound what a launch reads of a buffer whose rows are mostly
# empty.  FENCE: the fold protocol, 1 = acq_rel tickets (the rule), 0 = hardware order (outside the
# PTX model, not a candidate), 3 / 4 = release only from programs that wrote a max (kernel comments).
# RULE's FENCE field is b80dba5's; the launched FENCE is CANDIDATES[DEFAULT]'s (default_config).
Config = tuple[int, int, int, int, int, int]

# The launcher's rule: tiers by work W = B * S (both fixed when a graph is captured, so the choice
# is one launch of one config).  From the H200 sweep of 2126580 (NOTES.md: every config on all 32
# bench rows, two passes, before and vLLM in the same rows); numbers are µs, rule vs the 3236c0e
# default in the same run.
RULE: tuple[tuple[int, Config], ...] = (
    # W <= 32K (8K/32K B1): one-warp programs of 128 tokens: no block barrier in the reductions and
    # <= 256 programs; 8K B1 n6-12 2.98 / 2.90 (was 3.81 / 3.80), 32K B1 3.09 / 3.00 (3.92 / 3.82).
    (1 << 15, (1, 1, 1, 8192, 1, 0)),
    # W <= 128K (8K B8, 100K B1): one-warp programs of 256 tokens (128-token ones pass 500 programs
    # and lose: 100K B1 n5-5 quote 1.13x the old default); 100K B1 n6-12 3.30 / 3.26 (3.91 / 3.94),
    # 8K B8 n6-12 3.24 / 3.18 (4.04 / 3.98); worst row 100K B1 n5-5 quote 3.23 vs 3.08 (1.05x, the
    # old default's own two passes there: 2.95 / 3.21).
    (1 << 17, (2, 1, 1, 4096, 1, 0)),
    # W <= 1M (256K B1, 32K B8, 100K B8): 1024-token tiles of 4 warps, ORDER=1 (the tile's loads
    # issued before the length's: geometric mean 3-8% off n6-12 rows on 4-warp tiles, 1-4% more on
    # n5-5 rows and on one-warp tiles); 256K B1 n6-12 3.85 / 3.96 (4.45 / 4.60), 32K B8 4.00 / 4.09
    # (4.38 / 4.54), 100K B8 5.14 / 5.95 (5.57 / 6.22); n5-5 rows 1.00-1.03x.
    (1 << 20, (2, 1, 4, 2048, 1, 1)),
)
# Past 1M (256K B8): 2048-token tiles, 16 contiguous tokens per thread, the 3236c0e default there; no
# candidate beats it on all four rows (256-token one-warp 0.93x on n6-12 vocab 8 but 1.13-1.20x on
# quoting; the others 0.99x at best; ORDER=1 1.00-1.07x).
CONFIG_LARGE: Config = (4, 1, 4, 1024, 1, 0)
# Row-local scoring keys (_tile_scores_fast): identical scores, ~12% fewer warp instructions at
# 256K B8 n5-5 vocab 8, but 58 -> 91 registers under Triton 3.6 (two waves of the 1024-program
# grid); with COVER it compiles to 40 and MAXNREG=64 holds it one wave: candidate c2's last tier.
FAST = 0


def workspace_numel(batch: int) -> int:
    """int64 elements of the workspace for B requests: one 128-byte line per request (SPREAD=1;
    SPREAD=0 uses the first 2 * B), then one int32 slot per program (POLL=1: B * P <= max(8192,
    8 B) for every RULE tier, P = min(tiles, max(8, cap // B))).  Callers allocate zeros of this
    size once and reuse them; the kernel leaves them zero."""
    return 16 * batch + max(8192, 8 * batch) // 2


def block_tokens(config: tuple[int, ...]) -> int:
    """Tokens per tile: ROWS = 32 * warps * G rows of 4 * NV tokens."""
    nv, g, nw = config[:3]
    return 4 * nv * g * 32 * nw


# Launcher defaults beyond the tile: name -> (FENCE, kernel switches per tier: RULE's three, then
# CONFIG_LARGE's).  Switches: SPREAD=1 one 128-byte workspace line per request (workspace_numel);
# COVER=1 the loop-free kernel where the grid covers the buffer; EDGE_ONLY=1 one scoring copy (the
# edge one) instead of two; FAST=1 row-local keys; MAXNREG = ptxas register cap (launch option);
# TICKETS = T two-level tickets (T group words per request).  "cur" = the rule of b80dba5; c1-c3 =
# the 2026-11-30 candidates.  H200 call of f12ad3c (NOTES.md, rule fixed before the call): c1 wins
# (32 bench rows vs cur: geometric mean 0.938, worst 1.01x; goal rows a 3.04-3.26 vs 3.16-3.59,
# b vocab 8 7.73-7.87 vs 8.23-8.44); c2 worst row 1.09x (EDGE_ONLY at 8K B8 n5-5 quote); c3 1.14x
# (the second ticket trip costs ~0.9 µs).
_C1 = {"SPREAD": 1, "COVER": 1}
CANDIDATES: dict[str, tuple[int, tuple[dict[str, Any], ...]]] = {
    "cur": (1, ({}, {}, {}, {})),
    "c1": (4, (_C1, _C1, _C1, _C1)),
    "c2": (4, ({**_C1, "EDGE_ONLY": 1}, {**_C1, "EDGE_ONLY": 1}, _C1, {**_C1, "FAST": 1, "MAXNREG": 64})),
    "c3": (4, ({**_C1, "EDGE_ONLY": 1, "TICKETS": 15}, {**_C1, "EDGE_ONLY": 1, "TICKETS": 15}, {**_C1, "TICKETS": 8},
               {**_C1, "FAST": 1, "MAXNREG": 64, "TICKETS": 8})),
}
# c4 / c5 (2026-11-30, session 4; NOTES.md sweep 2): the four-warp 1024-token tier takes FAST 2 + HIT 3
# (auto2's tier-2 part); 256K B8's tier with max_n <= 5 takes the sweep-2 pick for row b: 4-token rows
# (NV 1, G 4: a warp's load covers 512 contiguous bytes), FAST 2, HIT 3; c5 adds HIT 3 to that tier's
# other rows (n 6-12 keep the 16-token rows: their three halo vectors would quadruple the loads).
_C4_T2 = {**_C1, "FAST": 2, "HIT": 3}
_SHORT_B = {"TILE": (1, 4, 4, 1024, 0), "FAST": 2, "HIT": 3}
CANDIDATES["c4"] = (4, (_C1, _C1, _C4_T2, {**_C1, "SHORT": _SHORT_B}))
CANDIDATES["c5"] = (4, (_C1, _C1, _C4_T2, {**_C1, "HIT": 3, "SHORT": _SHORT_B}))
# Tried and dropped in session 4 (H200, NOTES.md): c6 = c5 + SLOTS (tagged draft slots, commit 74ac6ef)
# and c7 = c5 with FENCE 5 (ticket first, commit 0049e9d), both slower than c5 on most rows.
# H200 call 2 of 2026-11-30 (session 4; ours = c4, c1 and c5 beside it, two bench passes): by the rule
# fixed before the call (NOTES.md) c5 is eligible (worst row 1.056x c1, geometric mean 0.987, 256K B8
# n5-5 6.39 / 6.76 µs vs c1 6.71 / 7.81) and c4 is not (1.072x on 8K B8 n5-5 vocab 8, a row where
# its code is c1's: noise, but the rule is the rule).
# H200 calls 4 and 6: c6 and c7 lose to c5 on most rows (NOTES.md): c5 stays.
# c10 / c11 (session 6): POLL=1 (per-program slots and a polling last program instead of the
# max word and the tickets; triton._poll_slots) on every tier / on the one-warp tiers only.
def _plus(per_tier: tuple[dict[str, Any], ...], extra: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """Per-tier switches with `extra` added on every tier (and in its SHORT overrides)."""
    return tuple({**t, **extra, **({"SHORT": {**t["SHORT"], **extra}} if "SHORT" in t else {})} for t in per_tier)


CANDIDATES["c10"] = (4, _plus(CANDIDATES["c5"][1], {"POLL": 1}))
CANDIDATES["c11"] = (4, (*CANDIDATES["c10"][1][:2], *CANDIDATES["c5"][1][2:]))
# c12: c10 where a request has at most 256 programs.  H200 (session 6, NOTES.md): POLL gains 3-14% on
# the rows with few programs per request (8K B1 / B8, 32K B1 / B8, 100K B8, 256K B8) and loses 4-8% at
# 100K B1 (391 programs: the poller's 16 slot loads per lane per poll), whatever the tile there.
CANDIDATES["c12"] = (4, _plus(CANDIDATES["c5"][1], {"POLL_MAX_P": 256}))
# H200 call 5 of session 6 (rule fixed before it, NOTES.md; two bench passes, candidates timed after
# and then before ours): c12 / c5 worst row 1.019, geometric mean 0.955 over the 32 rows, 256K B8
# n5-5 6.22-6.25 / 6.39-6.45 µs vs 6.37-6.42 / 6.70-6.74: c12 becomes DEFAULT.
# c19 (session 9): c12 + WORDS (triton._fold_words) where a request takes tickets (> 256 programs: 100K
# B1 of the bench): the draft rides with the max in the request's line and the ticket counts matches.
CANDIDATES["c19"] = (4, _plus(CANDIDATES["c12"][1], {"WORDS": 1}))
# H200 calls 1-2 of session 9 (rule fixed before them, NOTES.md; three bench passes, the candidate
# timed after and before ours): 100K B1 n6-12 quote 3.01 / 3.20 / 3.02 µs vs c12 3.24 / 3.17 / 3.31,
# vocab 8 2.75 / 2.72 / 2.75 vs 3.06 / 3.06 / 3.09; every other row 0.98-1.03x (the launcher runs
# c12's code there): c19 becomes DEFAULT.
# c20 (session 12): c19 + DIRECT (triton._fold_direct) on the same ticket path: the matches fold into
# the outputs themselves and the finisher masks the scores off with REDs, reading nothing after its
# ticket (c19's finisher reads the words' line: one L2 round trip on the quoting row).
CANDIDATES["c20"] = (4, _plus(CANDIDATES["c19"][1], {"DIRECT": 1}))
# H200 call 1 of session 12 (rule fixed before it, NOTES.md; two bench passes, the candidate timed
# after and before ours): 100K B1 n6-12 quote 2.94 / 2.93 µs vs c19 3.15 / 3.10, n5-5 rows 0.89-0.94x,
# vocab 8 2.80 / 2.81 vs 2.75 / 2.80 (no match there: the same path run); 32 rows 0.98-1.02x
# elsewhere, geometric mean 0.992: c20 becomes DEFAULT.
# c21 (session 12, commit 3568246): DIRECT on the POLL path too (release slot RMWs, an acquire fence
# after the poll, masks instead of the poller's draft read): 1.07-1.26x slower than c20 on every POLL
# row of the H200 bench (the poller's fence, no-match rows included); removed (NOTES.md).
DEFAULT = "c20"


def _tier(work: int) -> int:
    for i, (limit, _) in enumerate(RULE):
        if work <= limit:
            return i
    return len(RULE)


def tier_candidate(name: str, tier: int, max_n: int = 0) -> tuple[Config, dict[str, Any]]:
    """(config, opts) of the named launcher default on RULE's tier `tier` (len(RULE): the large one).
    A tier's opts may carry "TILE" = (NV, G, warps, cap, ORDER), replacing RULE's tile there, and
    "SHORT" = opts (TILE included) that apply when 1 <= max_n <= 5 (a one-vector halo: the
    coalesced 4-token-row tiles pay no extra halo loads there)."""
    fence, per_tier = CANDIDATES[name]
    base = RULE[tier][1] if tier < len(RULE) else CONFIG_LARGE
    opts = {"FAST": FAST, **per_tier[tier]}
    short = opts.pop("SHORT", None)
    if short is not None and 1 <= max_n <= 5:
        opts.update(short)
    tile = opts.pop("TILE", None)
    if tile is not None:
        base = (*tile[:4], fence, tile[4])
    return (*base[:4], fence, base[5]), opts


def candidate(name: str, batch: int, capacity: int, max_n: int = 0) -> tuple[Config, dict[str, Any]]:
    """(config, opts) of the named launcher default for B requests over an [*, S] buffer."""
    return tier_candidate(name, _tier(batch * capacity), max_n)


def default_config(batch: int, capacity: int, max_n: int = 0) -> Config:
    """The config for B requests over an [*, S] history buffer (RULE, DEFAULT's fence)."""
    return candidate(DEFAULT, batch, capacity, max_n)[0]


def default_opts(batch: int, capacity: int, max_n: int = 0) -> dict[str, Any]:
    """The kernel switches of DEFAULT for B requests over an [*, S] buffer."""
    return candidate(DEFAULT, batch, capacity, max_n)[1]
