"""Triton lookup-drafting scan: one launch, register tiles, 32-bit atomic-max fold.

Each program walks candidate *end* positions e <= L-2 and measures the backward match length
m(e) = #{j < max_n : h[e-j] == h[L-1-j] for all smaller j}.  A match of length n starts at e-n+1
and the draft begins at e+1 whatever n is, so the packed score (m << 26 | e+1) maximised over e
gives the longest n and then the most recent position, exactly the serial rule.

Tile layout: a program's tile is [ROWS, 4 * NV] tokens, one row per thread (G = ROWS / (32 * warps)
rows each), loaded as 16-byte vectors and split into columns in registers; HV = ceil((max_n-1)/4)
more vectors before each row (the halo, L1 hits on the neighbours' lines) make h[e-j] a register
for every j, so the run length is an AND chain of compares (about two instructions per position
and j) instead of a gather per j.  The whole tile, halo included, is loaded before seq_lens is
known (its address does not depend on the length), so every load of a program is in flight at once
and the program pays the DRAM latency once.  Tiles without a single hit (quoting histories: almost
all) stop after the hit test.

The fold (one graph-capturable launch does the whole lookup): up to ``Launch.poll_max_p`` programs
per request (POLL), each program but the last writes its maximum into its own workspace slot and
the last polls the slots (_poll_slots).  Above, programs take a ticket on their request's line
(acquire; release only from a program with a match) and the last arrival finishes: with WORDS the
draft rides with the max and the ticket counts the matches (_fold_words), with DIRECT on top the
matches fold into the outputs themselves and the last arrival masks the scores off, reading
nothing after its ticket (_fold_direct); without either (k > 8) it reads the max word and the
draft.  The workspace is the caller's int64 [workspace_numel(B)] zeros, used as int32 words (one
128-byte line per request, then the POLL slots).  Past the program cap a program loops over
further tiles (loaded after the length is known); COVER compiles that loop out where the grid
covers the buffer.  The launcher's rule (config.py) picks the tile and the paths by B * S.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lookup_scan.config import Launch, block_tokens, default_launch, workspace_numel

# Packed score: m << POS_BITS | e + 1, m <= 31, so histories must be shorter than 2**POS_BITS.
POS_BITS = 26


@triton.jit
def _split4(x, ROWS: tl.constexpr):
    """[ROWS, 4] (a 16-byte vector per thread) -> its four columns [ROWS], register moves only."""
    a, b = tl.split(tl.reshape(x, [ROWS, 2, 2]))  # a: columns 0, 2; b: columns 1, 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _load_tile(p_h, base, S, ROWS: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr):
    """Columns of the tile at token `base` (row r holds base + r*4*NV + [0, 4*NV)), preceded by
    4*HV halo columns (the tokens before each row): a tuple of 4*(HV+NV) [ROWS] tensors, column k
    of the tuple at row offset k - 4*HV.  Positions outside [0, S) read 0 (see _tile_best)."""
    row0 = base + tl.arange(0, ROWS) * (4 * NV)
    o_c = tl.arange(0, 4)
    cols = ()
    for v in tl.static_range(-HV, NV):
        pos = row0[:, None] + (4 * v) + o_c[None, :]
        x = tl.load(p_h + pos, mask=(pos >= 0) & (pos < S), other=0)
        c0, c1, c2, c3 = _split4(x, ROWS)
        cols = cols + (c0, c1, c2, c3)
    return cols


@triton.jit
def _tile_scores(cols, s, row0, L, EDGE: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr,
                 MIN_N: tl.constexpr, MAX_N: tl.constexpr, POS_BITS: tl.constexpr, ROWKEY: tl.constexpr):
    """Per-row max of m << POS_BITS | e + 1 over the row's end positions, m = 0 where the first
    MIN_N compares fail (so the max is a real match iff its m >= MIN_N).  EDGE: the tile holds
    positions < MAX_N - 1 or > L - 2 (clamp m to e + 1, zero it past L - 2); interior tiles skip
    both, leaving about two instructions per position and j.  ROWKEY: _tile_scores_rowkey."""
    if ROWKEY:
        acc = _tile_scores_rowkey(cols, s, row0, L, EDGE, NV, HV, MIN_N, MAX_N, POS_BITS)
    else:
        acc = _tile_scores_slow(cols, s, row0, L, EDGE, NV, HV, MIN_N, MAX_N, POS_BITS)
    return acc


@triton.jit
def _tile_scores_slow(cols, s, row0, L, EDGE: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr,
                      MIN_N: tl.constexpr, MAX_N: tl.constexpr, POS_BITS: tl.constexpr):
    """3236c0e's scoring: the packed score per position."""
    H: tl.constexpr = 4 * HV
    acc = tl.zeros_like(row0)
    for c in tl.static_range(4 * NV):
        a = cols[H + c] == s[0]
        for j in tl.static_range(1, MIN_N):
            a = a & (cols[H + c - j] == s[j])
        m = tl.where(a, MIN_N, 0)
        for j in tl.static_range(MIN_N, MAX_N):
            a = a & (cols[H + c - j] == s[j])
            m += a.to(tl.int32)
        e = row0 + c
        if EDGE:
            # h[e-j] for e-j < 0 was read as 0: a match cannot be longer than e+1 (NOTES.md)
            m = tl.where(e <= L - 2, tl.minimum(m, e + 1), 0)
        acc = tl.maximum(acc, (m << POS_BITS) | (e + 1))
    return acc


@triton.jit
def _tile_scores_rowkey(cols, s, row0, L, EDGE: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr,
                        MIN_N: tl.constexpr, MAX_N: tl.constexpr, POS_BITS: tl.constexpr):
    """_tile_scores with a row-local key: within a row the end positions are row0 + c, so the row's
    best is the max of (m, c) and the packed score is built once per row, not per position.
    MIN_N == MAX_N: m is MIN_N or nothing, so the key is the last matching column, each position
    tested with XOR-ORs; else (m << 5 | c + 1), 4 * NV <= 16 columns (one shift-add and one max).
    (HISTORY.md's "FAST 2"; FAST 1, the same keys with a compare chain at MIN_N == MAX_N, lost in
    session 4's candidates and sweep 2 and was removed in issue 22.)"""
    H: tl.constexpr = 4 * HV
    acc = tl.zeros_like(row0)  # key per row; 0 = no position
    if MIN_N == MAX_N:
        # XOR-OR form: d == 0 iff all MIN_N tokens equal; ptxas fuses each (x ^ y) | d into one LOP3,
        # so a position costs MIN_N LOP3 + one compare-select, with no predicate chains to spill.
        for c in tl.static_range(4 * NV):
            d = cols[H + c] ^ s[0]
            for j in tl.static_range(1, MIN_N):
                d = d | (cols[H + c - j] ^ s[j])
            ok = d == 0
            if EDGE:
                e = row0 + c
                ok = ok & (e <= L - 2) & (e >= MIN_N - 1)
            acc = tl.where(ok, c + 1, acc)
        return tl.where(acc > 0, (MIN_N << POS_BITS) | (row0 + acc), 0)
    for c in tl.static_range(4 * NV):
        a = cols[H + c] == s[0]
        for j in tl.static_range(1, MIN_N):
            a = a & (cols[H + c - j] == s[j])
        m = tl.where(a, MIN_N, 0)
        for j in tl.static_range(MIN_N, MAX_N):
            a = a & (cols[H + c - j] == s[j])
            m += a.to(tl.int32)
        if EDGE:
            e = row0 + c
            m = tl.where(e <= L - 2, tl.minimum(m, e + 1), 0)
        acc = tl.maximum(acc, (m << 5) | (c + 1))
    return ((acc >> 5) << POS_BITS) | (row0 + (acc & 31))


@triton.jit
def _tile_best(cols, s, base, L, active, ROWS: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr,
               MIN_N: tl.constexpr, MAX_N: tl.constexpr, POS_BITS: tl.constexpr, ROWKEY: tl.constexpr,
               HIT_N: tl.constexpr):
    """Best packed score over the tile's end positions (0 if none or not active); s = (h[L-1],
    h[L-2], ...).  The hit test reads the tile unconditionally, so the compiler cannot sink the
    tile's loads below the length's (one DRAM trip for both, see lookup_scan_kernel).
    The tile's hit test: HIT_N = the first MIN_N tokens, not just the last (MIN_N XOR-ORs per
    column; the halo's zeros and the suffix's own end can pass it, which only costs a scoring run;
    HISTORY.md's "HIT 3"); else an OR of compares with the last token (LLVM packs the 4*NV
    predicates into a bitmask: ~60 instructions at NV=4).  A min of XORs (HIT 1) and no test
    (HIT 2) lost in session 4's sweep 2 and were removed in issue 22."""
    H: tl.constexpr = 4 * HV
    BLOCK: tl.constexpr = ROWS * 4 * NV
    if HIT_N:
        # the first MIN_N tokens (XOR-OR, one LOP3 each): a vocab-8 history passes this in ~8**-MIN_N
        # of its positions instead of 1/8, so the scoring (the extension to MAX_N) rarely runs
        x = cols[H] ^ s[0]
        for j in tl.static_range(1, MIN_N):
            x = x | (cols[H - j] ^ s[j])
        for c in tl.static_range(1, 4 * NV):
            d = cols[H + c] ^ s[0]
            for j in tl.static_range(1, MIN_N):
                d = d | (cols[H + c - j] ^ s[j])
            x = tl.minimum(x, d)
        hit_any = (tl.min(x) == 0) & active
    else:
        hit = cols[H] == s[0]
        for c in tl.static_range(1, 4 * NV):
            hit = hit | (cols[H + c] == s[0])
        hit_any = (tl.max(hit.to(tl.int32)) > 0) & active
    best = tl.zeros((), dtype=tl.int32)
    if hit_any:  # quoting histories: almost every tile stops here
        row0 = base + tl.arange(0, ROWS) * (4 * NV)
        if (base >= MAX_N) & (base + BLOCK <= L - 1):
            best = tl.max(_tile_scores(cols, s, row0, L, False, NV, HV, MIN_N, MAX_N, POS_BITS, ROWKEY))
        else:
            best = tl.max(_tile_scores(cols, s, row0, L, True, NV, HV, MIN_N, MAX_N, POS_BITS, ROWKEY))
        best = tl.where((best >> POS_BITS) >= MIN_N, best, 0)
    return best


@triton.jit
def _stamp(dep):
    """%globaltimer (ns), read once `dep` is available (STAMPS=1 diagnostics, diag.py --stamps)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def lookup_scan_kernel(
    tokens, s_tok, req_idx, seq_lens, drafts, num_valid, ws, stamps,
    S, P, B,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, K_DRAFT: tl.constexpr, KP: tl.constexpr,
    ROWS: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr, HAS_REQ_IDX: tl.constexpr,
    POS_BITS: tl.constexpr, NV_BITS: tl.constexpr, ORDER: tl.constexpr, ROWKEY: tl.constexpr,
    HIT_N: tl.constexpr, COVER: tl.constexpr, POLL: tl.constexpr, PP: tl.constexpr, WORDS: tl.constexpr,
    DIRECT: tl.constexpr, STAMPS: tl.constexpr,
):
    BLOCK: tl.constexpr = ROWS * 4 * NV
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    p_st = stamps + (i_b * P + i_p) * 8  # STAMPS only (unused otherwise)
    if STAMPS:  # timing only: int64 [B, P, 8] ns stamps (entry, length, scan done, ticket, max, draft)
        t_entry = _stamp(i_p)
    # The request's own 128-byte line of the workspace (workspace_numel): the max (or WORDS's draft
    # words) in its first half, the ticket in its second (one line for all requests' words put
    # 1024 atomics on one 64-byte line at 256K B8: c1 beat it, HISTORY.md).
    w_max = ws + i_b * 32  # int32 words
    w_tk = w_max + 16
    row = tl.load(req_idx + i_b).to(tl.int64) if HAS_REQ_IDX else i_b.to(tl.int64)
    p_h = tokens + row * s_tok
    # The first tile (halo included) is loaded before the length is known: one DRAM trip for both.
    cols = _load_tile(p_h, i_p * BLOCK, S, ROWS, NV, HV)
    if ORDER:
        # ptxas otherwise issues the suffix loads (which wait for seq_lens) ahead of the tile's, so
        # the tile's DRAM trip starts only once the length has arrived.  No memory op crosses a
        # barrier and it does not wait for loads: the tile is in flight before the length is asked.
        tl.debug_barrier()
    L = tl.load(seq_lens + row).to(tl.int32)
    if STAMPS:
        t_len = _stamp(L)
    n_tiles = tl.cdiv(L - 1, BLOCK)
    # Programs with no end position to scan take no ticket: the finisher counts n_act tickets.
    n_act = tl.maximum(tl.minimum(n_tiles, P), 1)
    s = ()
    for j in tl.static_range(MAX_N):  # the suffix, last token first; all loads in flight at once
        s = s + (tl.load(p_h + L - 1 - j, mask=L - 1 - j >= 0, other=0),)
    # Not inside `if i_p < n_act`: the compiler would sink the tile's loads into the branch, after
    # the length's load (two DRAM trips; seen in the sm_90 SASS).
    best = _tile_best(cols, s, i_p * BLOCK, L, i_p < n_act, ROWS, NV, HV, MIN_N, MAX_N, POS_BITS, ROWKEY, HIT_N)
    if not COVER:  # COVER: the grid covers the buffer (P * BLOCK >= S - 1), the loop never runs
        for t in range(i_p + P, n_tiles, P):  # only past the program cap (never for idle programs)
            cols_t = _load_tile(p_h, t * BLOCK, S, ROWS, NV, HV)
            best = tl.maximum(best, _tile_best(cols_t, s, t * BLOCK, L, True, ROWS, NV, HV, MIN_N, MAX_N,
                                               POS_BITS, ROWKEY, HIT_N))
    if STAMPS:
        tl.store(p_st, t_entry)
        tl.store(p_st + 1, t_len)
        tl.store(p_st + 2, _stamp(best))
    if POLL:
        if i_p < n_act:
            # Per-program slots after the B lines: ws[32 B + i_b P + i_p] = best + 1 (0 = not yet).
            w_sl = ws + 32 * B + i_b * P
            if i_p == n_act - 1:
                best = _poll_slots(w_sl, best, n_act, PP)
                if STAMPS:
                    tl.store(p_st + 3, _stamp(best))
                    tl.store(p_st + 4, _stamp(best))
                _finish(p_h, best, L, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, POS_BITS, STAMPS)
            else:
                # A relaxed RMW (a RED: fire and forget, no fence): the slot is the whole message
                # (the draft is read from the history, which no program writes), so nothing else
                # has to be ordered before it.
                tl.atomic_max(w_sl + i_p, best + 1, sem="relaxed")
    elif i_p < n_act:
        # Tickets: every ticket acquires (ATOM + L1 invalidate, no MEMBAR); only a program that
        # wrote a max (or folded words) also releases (acq_rel: MEMBAR first).  Whoever draws the
        # last ticket has read the end of every release sequence, so it needs no fence of its own:
        # the last program of a quoting history pays no MEMBAR (HISTORY.md's FENCE 4; FENCE 1,
        # every ticket acq_rel, cost that finisher ~0.3 µs).
        if DIRECT:
            ticket = _fold_direct(w_tk, best, p_h, L, s[0], drafts, num_valid, i_b, K_DRAFT, KP, POS_BITS, NV_BITS)
        elif WORDS:
            ticket = _fold_words(w_max, w_tk, best, p_h, L, K_DRAFT, KP, POS_BITS)
        elif best > 0:
            tl.atomic_max(w_max, best, sem="relaxed")
            ticket = tl.atomic_add(w_tk, 1, sem="acq_rel")
        else:
            ticket = tl.atomic_add(w_tk, 1, sem="acquire")
        if STAMPS:
            tl.store(p_st + 3, _stamp(ticket))
        if WORDS:
            tl.static_assert(KP <= 8, "WORDS: k <= 8")
            if (ticket & 0xFFFF) == n_act - 1:
                # matches before this program's ticket (bits 16-31 of what it read) and its own
                n_match = (ticket >> 16) + (best > 0).to(tl.int32)
                if DIRECT:
                    _finish_direct(w_tk, n_match, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, NV_BITS, STAMPS)
                else:
                    _finish_words(w_max, w_tk, n_match, L, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, POS_BITS,
                                  STAMPS)
        elif ticket == n_act - 1:
            # Last program of the request: every max is visible (acquire); plain loads/stores
            # suffice, no other program touches the two words again in this launch.
            best = tl.load(w_max, volatile=True)
            if STAMPS:
                tl.store(p_st + 4, _stamp(best))
            tl.store(w_max, 0)
            tl.store(w_tk, 0)
            _finish(p_h, best, L, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, POS_BITS, STAMPS)


@triton.jit
def _fold_words(w_max, w_tk, best, p_h, L, K_DRAFT: tl.constexpr, KP: tl.constexpr, POS_BITS: tl.constexpr):
    """WORDS=1's fold (the tickets' fences above): the draft rides with the max and the ticket counts the
    matches, so the last arrival reads at most one line after its ticket (c12 reads the max word,
    then the draft from the history: two dependent L2 trips) and nothing where no program matched.
    Word k < K_DRAFT <= 8 of the request's line (int64, bytes 8k..8k+7; the ticket is at byte 64)
    is the max over programs with a match of score << 32 | draft token k: scores are unique (they
    hold the position), so it ends as the winner's token k, and word 0 (every match has >= 1 token
    after it) holds the max in its high half.  A program with a match gathers its own draft (the
    tokens after its best end: its tile's lines or the next tile's), folds it with relaxed 64-bit
    REDs and releases them with its ticket, which adds 1 + (1 << 16): bits 0-15 count arrivals,
    16-31 matches (P <= 65535).  The others only acquire.  The word is the int32 workspace pointer
    cast, not a second argument (c9 / c14's second pointer cost ~0.15 µs, NOTES.md)."""
    if best > 0:
        o_k = tl.arange(0, KP)
        _, n_own, d_own = _own_draft(best, p_h, L, K_DRAFT, KP, POS_BITS)
        w64 = w_max.to(tl.pointer_type(tl.int64))
        tl.atomic_max(w64 + o_k, (best.to(tl.int64) << 32) | (d_own & 0xFFFFFFFF), mask=o_k < n_own,
                      sem="relaxed")
        ticket = tl.atomic_add(w_tk, 1 + (1 << 16), sem="acq_rel")
    else:
        ticket = tl.atomic_add(w_tk, 1, sem="acquire")
    return ticket


@triton.jit
def _own_draft(best, p_h, L, K_DRAFT: tl.constexpr, KP: tl.constexpr, POS_BITS: tl.constexpr):
    """(e + 1, count, tokens [KP] int64) of a program's own best match (WORDS and DIRECT folds): the
    tokens after its best end position (its tile's lines or the next tile's), K_DRAFT of them or
    fewer at the history's end."""
    o_k = tl.arange(0, KP)
    own = best & ((1 << POS_BITS) - 1)
    n_own = tl.minimum(L - own, K_DRAFT)
    return own, n_own, tl.load(p_h + own + o_k, mask=o_k < n_own, other=0).to(tl.int64)


@triton.jit
def _finish_words(w_max, w_tk, n_match, L, s, drafts, num_valid, i_b, p_st, K_DRAFT: tl.constexpr,
                  KP: tl.constexpr, POS_BITS: tl.constexpr, STAMPS: tl.constexpr):
    """The last arrival of a WORDS fold: with no match it stores the fallback proposal (the last
    token, num_valid 0) without a read; else it reads the K_DRAFT words (one L2 trip; plain loads:
    its acquire ticket ordered every release before them) and zeroes them for the next launch."""
    o_d = tl.arange(0, KP)
    best = n_match * 0
    d_tok = tl.zeros([KP], dtype=tl.int64)
    if n_match > 0:
        w64 = w_max.to(tl.pointer_type(tl.int64))
        words = tl.load(w64 + o_d, mask=o_d < K_DRAFT, other=0)  # [KP] score << 32 | token
        best = tl.max(words >> 32, axis=0).to(tl.int32)
        d_tok = words & 0xFFFFFFFF
        tl.store(w64 + o_d, tl.zeros([KP], dtype=tl.int64), mask=o_d < K_DRAFT)
    if STAMPS:
        tl.store(p_st + 4, _stamp(best))
    tl.store(w_tk, 0)
    _, nv = _draft_span(best, L, K_DRAFT, POS_BITS)
    _store_proposal(d_tok, nv, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, STAMPS)


# DIRECT's packed num_valid fold, m << POS_BITS | (e + 1) << NV_BITS | count, orders as the score
# does (m, then the position): positions stay below 2**(POS_BITS - NV_BITS) (the launcher's check).
NV_BITS = 4


@triton.jit
def _fold_direct(w_tk, best, p_h, L, last, drafts, num_valid, i_b, K_DRAFT: tl.constexpr, KP: tl.constexpr,
                 POS_BITS: tl.constexpr, NV_BITS: tl.constexpr):
    """DIRECT=1's fold (WORDS's tickets and fences): the outputs are the fold's words, so the
    last arrival reads nothing after its ticket.  A program with a match folds, with relaxed
    64-bit REDs, score << 32 | token into every one of the request's K_DRAFT draft slots (its own
    draft tokens, then the last token where the history ends first: the reference's fill) and
    m << POS_BITS | (e + 1) << NV_BITS | count into num_valid, then releases them with its ticket
    (+1 + (1 << 16), as WORDS).  Scores are unique and every match writes every slot, so each slot
    ends as the winner's; the finisher masks the score off in place (_finish_direct).  The outputs
    must start below the fold's range (drafts < 2**58, num_valid < 2**26: zeros, negative fills
    or this kernel's previous proposals), which the kernel itself leaves behind."""
    if best > 0:
        o_k = tl.arange(0, KP)
        own, n_own, d_own = _own_draft(best, p_h, L, K_DRAFT, KP, POS_BITS)
        tok = tl.where(o_k < n_own, d_own, last.to(tl.int64)) & 0xFFFFFFFF
        tl.atomic_max(drafts + i_b * K_DRAFT + o_k, (best.to(tl.int64) << 32) | tok, mask=o_k < K_DRAFT,
                      sem="relaxed")
        packed = ((best >> POS_BITS) << POS_BITS) | (own << NV_BITS) | n_own
        tl.atomic_max(num_valid + i_b, packed, sem="relaxed")
        ticket = tl.atomic_add(w_tk, 1 + (1 << 16), sem="acq_rel")
    else:
        ticket = tl.atomic_add(w_tk, 1, sem="acquire")
    return ticket


@triton.jit
def _finish_direct(w_tk, n_match, s, drafts, num_valid, i_b, p_st, K_DRAFT: tl.constexpr, KP: tl.constexpr,
                   NV_BITS: tl.constexpr, STAMPS: tl.constexpr):
    """The last arrival of a DIRECT fold: with no match it stores the fallback proposal (the last
    token, num_valid 0); else it clears the folded scores with relaxed AND REDs (its acquire ticket
    ordered every fold before them, so each AND comes last in its slot's coherence order).  No load
    after the ticket: WORDS's finisher read the words' line (one L2 round trip) first."""
    o_d = tl.arange(0, KP)
    p_d = drafts + i_b * K_DRAFT + o_d
    if STAMPS:
        tl.store(p_st + 4, _stamp(n_match))
    tl.store(w_tk, 0)
    if n_match > 0:
        if STAMPS:
            tl.store(p_st + 5, _stamp(n_match))
        tl.atomic_and(p_d, tl.full([KP], 0xFFFFFFFF, tl.int64), mask=o_d < K_DRAFT, sem="relaxed")
        tl.atomic_and(num_valid + i_b, (1 << NV_BITS) - 1, sem="relaxed")
    else:
        _store_proposal(tl.zeros([KP], dtype=tl.int64), n_match * 0, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP,
                        STAMPS)


@triton.jit
def _finish(p_h, best, L, s, drafts, num_valid, i_b, p_st, K_DRAFT: tl.constexpr, KP: tl.constexpr,
            POS_BITS: tl.constexpr, STAMPS: tl.constexpr):
    """The request's proposal from its best packed score: the K_DRAFT tokens after the winning end
    position (fewer at the history's end), the last token in the slots past num_valid."""
    o_d = tl.arange(0, KP)
    start, nv = _draft_span(best, L, K_DRAFT, POS_BITS)
    d_tok = tl.load(p_h + start + o_d, mask=o_d < nv, other=0)
    _store_proposal(d_tok, nv, s, drafts, num_valid, i_b, p_st, K_DRAFT, KP, STAMPS)


@triton.jit
def _draft_span(best, L, K_DRAFT: tl.constexpr, POS_BITS: tl.constexpr):
    """(start, count) of the proposal of a best packed score: the tokens from e + 1 of the winning
    end position, K_DRAFT of them or fewer at the history's end; count 0 without a match."""
    start = best & ((1 << POS_BITS) - 1)
    return start, tl.where(best > 0, tl.minimum(L - start, K_DRAFT), 0)


@triton.jit
def _store_proposal(d_tok, nv, s, drafts, num_valid, i_b, p_st, K_DRAFT: tl.constexpr, KP: tl.constexpr,
                    STAMPS: tl.constexpr):
    """Write the request's proposal: d_tok [KP] in the first nv slots, the last token s[0] past them."""
    o_d = tl.arange(0, KP)
    out = tl.where(o_d < nv, d_tok, s[0]).to(tl.int64)
    if STAMPS:
        tl.store(p_st + 5, _stamp(tl.sum(out, axis=0)))
    tl.store(drafts + i_b * K_DRAFT + o_d, out, mask=o_d < K_DRAFT)
    tl.store(num_valid + i_b, nv.to(tl.int32))


@triton.jit
def _poll_slots(w_sl, best, n_act, PP: tl.constexpr):
    """POLL=1's fold: the request's last active program waits (volatile loads, L2) until the other
    n_act - 1 programs have written their slots, takes the max and zeroes the slots for the next
    launch.  No ticket and no max word: where c5's last program pays a contended ticket RMW and
    then a max read (two dependent L2 trips after the last scan), the poller sees the last slot
    about one L2 trip after it lands.  It never waits for a program that cannot start: it holds one
    warp slot of one SM, the others run elsewhere or after their neighbours.  Triton's interpreter
    runs programs in grid order, so the slots are all written when the poller runs there."""
    o_s = tl.arange(0, PP)
    live = o_s < n_act - 1
    v = tl.load(w_sl + o_s, mask=live, other=1, volatile=True)  # [PP] best + 1, 0 = not yet
    while tl.min(v, axis=0) == 0:
        v = tl.maximum(v, tl.load(w_sl + o_s, mask=live & (v == 0), other=0, volatile=True))
    # A multi-warp program polls in every warp (v is replicated across them and the loop's reduction
    # is warp-local): no warp may zero the slots before every warp has left the loop, or the others
    # spin forever (seen on the H200: a four-warp poller hung without this barrier).
    tl.debug_barrier()
    tl.store(w_sl + o_s, tl.zeros_like(v), mask=live)
    return tl.maximum(best, tl.max(v, axis=0) - 1)


def zero_outputs(batch: int, num_draft: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent outputs for ``out=``: (drafts [B, num_draft] int64, num_valid [B] int32) zeros.
    Zeros, not empty: DIRECT folds into the outputs, which must start below the fold's range; the
    kernel leaves its proposals there, which are fine for the next call."""
    return (torch.zeros(batch, num_draft, dtype=torch.int64, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device))


def lookup_scan_fwd(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    min_n: int,
    max_n: int,
    num_draft: int,
    req_indices: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs_per_request: int | None = None,
    launch: Launch | None = None,
    stamps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; see kernels.lookup_scan.lookup_scan for the contract.  ``launch``: the tile and
    the paths (config.Launch; default: the rule's, config.default_launch); ``stamps``: int64
    [B, P, 8] zeros for per-program %globaltimer stamps (diag.py --stamps, GPU only)."""
    if not 1 <= min_n <= max_n or max_n > 31 or num_draft < 1:
        raise ValueError(f"need 1 <= min_n <= max_n <= 31 and num_draft >= 1, got {min_n}, {max_n}, {num_draft}")
    if token_ids.stride(-1) != 1 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids must be int32/int64 with unit last stride, got {token_ids.dtype} {token_ids.stride()}")
    if token_ids.shape[1] >= 2**POS_BITS:
        raise ValueError(f"history capacity {token_ids.shape[1]} exceeds the packed score (< 2**{POS_BITS})")
    B = token_ids.shape[0] if req_indices is None else req_indices.shape[0]
    dev = token_ids.device
    S = token_ids.shape[1]
    launch = launch or default_launch(B, S, max_n)
    block = block_tokens(launch)
    P = programs_per_request or max(1, min(triton.cdiv(S, block), max(8, launch.cap // max(B, 1))))
    poll = P <= launch.poll_max_p  # the poller reads P slots
    need = workspace_numel(B)
    if poll:  # one int32 slot per program after the B request lines (_poll_slots)
        need = max(need, 16 * B + triton.cdiv(B * P, 2))
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.int64, device=dev)
    elif workspace.dim() != 1 or workspace.numel() < need or workspace.dtype != torch.int64 or not workspace.is_contiguous():
        raise ValueError(f"workspace must be contiguous int64 [workspace_numel(B) = {need}] zeros, "
                         f"got {workspace.dtype} {tuple(workspace.shape)}")
    drafts, num_valid = out if out is not None else zero_outputs(B, num_draft, dev)
    # WORDS folds the ticket path's draft into the request's line: k <= 8 words.  DIRECT folds into
    # the outputs on WORDS's path (not POLL's: c21, HISTORY.md); its packed num_valid holds
    # positions < 2**22.
    words = launch.words and not poll and num_draft <= 8
    direct = launch.direct and words and S < 2 ** (POS_BITS - NV_BITS)
    lookup_scan_kernel[(P, B)](
        token_ids, token_ids.stride(0), req_indices if req_indices is not None else seq_lens, seq_lens,
        drafts, num_valid, workspace.view(torch.int32), stamps if stamps is not None else workspace, S, P, B,
        MIN_N=min_n, MAX_N=max_n, K_DRAFT=num_draft, KP=triton.next_power_of_2(num_draft),
        ROWS=32 * launch.warps * launch.g, NV=launch.nv, HV=triton.cdiv(max_n - 1, 4),
        HAS_REQ_IDX=req_indices is not None, POS_BITS=POS_BITS, NV_BITS=NV_BITS, ORDER=int(launch.order),
        ROWKEY=int(launch.rowkey), HIT_N=int(launch.hit_n),
        # the loop-free kernel where the grid covers every end position of the buffer (seq_lens <= S)
        COVER=int(P * block >= S - 1), POLL=int(poll), PP=triton.next_power_of_2(P) if poll else 1,
        WORDS=int(words), DIRECT=int(direct), STAMPS=int(stamps is not None), num_warps=launch.warps,
    )  # fmt: skip
    return drafts, num_valid
