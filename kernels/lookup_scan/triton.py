"""Triton lookup-drafting scan: one launch, many programs per request, atomic-max fold.

Instead of testing every n in [min_n, max_n] at every start position (vLLM's scan: sum(n) loads per
position), each program walks candidate *end* positions e <= L-2 and measures the backward match
length m(e) = #{j < max_n : h[e-j] == h[L-1-j] for all smaller j}.  A match of length n starts at
e-n+1 and the draft begins at e+1 whatever n is, so the packed score (min(m, max_n) << 32 | e+1)
maximised over e gives the longest n and then the most recent position, exactly the serial rule.
Most positions fail the first compare, so chunks without a single last-token hit skip the rest.

Programs fold their block maxima into a per-request int64 with a relaxed ``atomic_max``; the last
program of a request (an acq_rel ``atomic_add`` ticket, which also orders the max) reads the result
with a plain load, resets the two workspace words with plain stores and gathers the draft, so one
graph-capturable launch does the whole lookup.  The grid depends on the history capacity only: one
block per program up to a program cap, past it programs stride over the actual length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# End positions per block (4 per thread at 4 warps) and the cap on programs per request: H200
# sweep in NOTES.md (kernels/lookup_scan/bench.py --sweep).  The grid is sized by the history
# capacity S (CUDA-graph capturable), at most cdiv(S, BLOCK) programs per request; below the cap
# every program scans exactly one block.
BLOCK = 512
MAX_PROGRAMS = 2048  # per launch, over all requests (at least 32 per request)
NUM_WARPS = 4
# Fold variants (bench.py --sweep): SKIP reads the running max before the contended atomic_max;
# GROUPS > 1 folds in two levels (per-group words, then the request's), with a larger workspace.
SKIP = 0
GROUPS = 1


def workspace_numel(batch: int, groups: int = GROUPS) -> int:
    """int64 words of zeroed workspace a launch needs: max and ticket per request, plus per group."""
    return 2 * batch * (1 + (groups if groups > 1 else 0))


@triton.jit
def _block_best(p_h, e, tok, L, last, MIN_N: tl.constexpr, MAX_N: tl.constexpr):
    """Best packed score (m << 32 | e + 1) over one block of end positions e, tok = h[e]."""
    alive = (e <= L - 2) & (tok == last)
    best = tl.zeros((), dtype=tl.int64)
    if tl.max(alive.to(tl.int32)) > 0:  # quoting histories: most blocks stop here
        m = alive.to(tl.int32)
        if MAX_N > 1:
            # second filter: one more compare, masked, leaves ~1/vocab of the hits alive
            s_1 = tl.load(p_h + L - 2, mask=L >= 2, other=0)
            alive = alive & (e >= 1)
            alive = alive & (tl.load(p_h + e - 1, mask=alive, other=0) == s_1)
            m += alive.to(tl.int32)
            if MAX_N > 2:
                if tl.max(alive.to(tl.int32)) > 0:
                    a1 = alive
                    # the remaining compares load under the same mask, so they are all in flight
                    # at once (no load waits for the previous compare); the run length is an AND
                    # chain in registers
                    for j in tl.static_range(2, MAX_N):
                        s_j = tl.load(p_h + L - 1 - j, mask=L - 1 - j >= 0, other=0)
                        w_j = tl.load(p_h + e - j, mask=a1 & (e >= j), other=0)
                        alive = alive & (e >= j) & (w_j == s_j)
                        m += alive.to(tl.int32)
        score = tl.where(m >= MIN_N, (m.to(tl.int64) << 32) | (e + 1).to(tl.int64), 0)
        best = tl.max(score)
    return best


@triton.jit
def lookup_scan_kernel(
    tokens, s_tok, req_idx, seq_lens, drafts, num_valid, ws,
    S, P, B,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, K_DRAFT: tl.constexpr, KP: tl.constexpr,
    BLOCK: tl.constexpr, HAS_REQ_IDX: tl.constexpr, SKIP: tl.constexpr, GROUPS: tl.constexpr,
):
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    row = tl.load(req_idx + i_b).to(tl.int64) if HAS_REQ_IDX else i_b.to(tl.int64)
    p_h = tokens + row * s_tok
    # The first block is loaded before the length is known (its address does not depend on it,
    # the buffer holds S tokens per row), so the history and seq_lens reads share one DRAM trip.
    o_e = tl.arange(0, BLOCK)
    e = i_p * BLOCK + o_e
    tok = tl.load(p_h + e, mask=e < S, other=0)
    L = tl.load(seq_lens + row).to(tl.int64)
    # Programs with no end position to scan take no ticket: the finisher counts n_act tickets.
    n_act = tl.maximum(tl.minimum(tl.cdiv(L - 1, BLOCK), P), 1)
    if i_p < n_act:
        last = tl.load(p_h + L - 1, mask=L > 0, other=0)
        best = _block_best(p_h, e, tok, L, last, MIN_N, MAX_N)
        for c in range(i_p + P, tl.cdiv(L - 1, BLOCK), P):  # only past the program cap
            e_c = c * BLOCK + o_e
            tok_c = tl.load(p_h + e_c, mask=e_c < S, other=0)
            best = tl.maximum(best, _block_best(p_h, e_c, tok_c, L, last, MIN_N, MAX_N))

        if GROUPS > 1:
            # Two-level fold: program i_p joins group i_p % GROUPS (its own max and ticket words,
            # P / GROUPS programs each); the last program of a group folds the group's max into
            # the request's words, so those see at most GROUPS atomics instead of n_act.
            g = i_p % GROUPS
            p_g = ws + 2 * B + (i_b * GROUPS + g) * 2
            if best > 0:
                tl.atomic_max(p_g, best, sem="relaxed")
            n_g = (n_act - g + GROUPS - 1) // GROUPS  # active programs of this group
            last_g = tl.atomic_add(p_g + 1, 1, sem="acq_rel") == n_g - 1
            if last_g:
                best = tl.load(p_g, volatile=True)
                tl.store(p_g, 0)
                tl.store(p_g + 1, 0)
            n_fold = tl.minimum(n_act, GROUPS)  # groups with at least one active program
        else:
            last_g = True
            n_fold = n_act
        ticket = n_act * 0 - 1  # int64 like the atomic's result
        if last_g:
            if best > 0:  # most programs of a quoting history find nothing: spare the contended word
                if SKIP:
                    # read first: a program whose best is not above the running max skips the
                    # contended atomic (the max only grows, so skipping cannot lose the winner)
                    if best > tl.load(ws + i_b, volatile=True):
                        tl.atomic_max(ws + i_b, best, sem="relaxed")
                else:
                    tl.atomic_max(ws + i_b, best, sem="relaxed")
            ticket = tl.atomic_add(ws + B + i_b, 1, sem="acq_rel")  # release orders the max above
        if ticket == n_fold - 1:
            # Last program of the request: every max is visible (acquire); plain loads/stores
            # suffice, no other program touches the two words again in this launch.
            best = tl.load(ws + i_b, volatile=True)
            tl.store(ws + i_b, 0)
            tl.store(ws + B + i_b, 0)
            start = best - ((best >> 32) << 32)  # e + 1 of the winning end position
            nv = tl.where(best > 0, tl.minimum(L - start, K_DRAFT), 0)
            o_d = tl.arange(0, KP)
            d_tok = tl.load(p_h + start + o_d, mask=o_d < nv, other=0)
            out = tl.where(o_d < nv, d_tok, last).to(tl.int64)
            tl.store(drafts + i_b * K_DRAFT + o_d, out, mask=o_d < K_DRAFT)
            tl.store(num_valid + i_b, nv.to(tl.int32))


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
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
    skip: int = SKIP,
    groups: int = GROUPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; see kernels.lookup_scan.lookup_scan for the contract.  ``skip`` and ``groups``
    are the fold variants timed by bench.py --sweep (kernel docstring); groups > 1 needs a
    workspace of ``workspace_numel(B, groups)`` int64 zeros instead of 2 * B."""
    if not 1 <= min_n <= max_n or max_n > 31 or num_draft < 1:
        raise ValueError(f"need 1 <= min_n <= max_n <= 31 and num_draft >= 1, got {min_n}, {max_n}, {num_draft}")
    if token_ids.stride(-1) != 1 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids must be int32/int64 with unit last stride, got {token_ids.dtype} {token_ids.stride()}")
    if token_ids.shape[1] >= 2**31:
        raise ValueError(f"history capacity {token_ids.shape[1]} exceeds the packed score")
    B = token_ids.shape[0] if req_indices is None else req_indices.shape[0]
    dev = token_ids.device
    n_ws = workspace_numel(B, groups)
    if workspace is None:
        workspace = torch.zeros(n_ws, dtype=torch.int64, device=dev)
    elif workspace.shape != (n_ws,) or workspace.dtype != torch.int64:
        raise ValueError(f"workspace must be int64 [{n_ws}] zeros, got {workspace.dtype} {tuple(workspace.shape)}")
    drafts, num_valid = out if out is not None else (
        torch.empty(B, num_draft, dtype=torch.int64, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
    )
    S = token_ids.shape[1]
    P = programs_per_request or max(1, min(triton.cdiv(S, block), max(32, MAX_PROGRAMS // max(B, 1))))
    lookup_scan_kernel[(P, B)](
        token_ids, token_ids.stride(0), req_indices if req_indices is not None else seq_lens, seq_lens,
        drafts, num_valid, workspace, S, P, B,
        MIN_N=min_n, MAX_N=max_n, K_DRAFT=num_draft, KP=triton.next_power_of_2(num_draft),
        BLOCK=block, HAS_REQ_IDX=req_indices is not None, SKIP=bool(skip), GROUPS=groups,
        num_warps=num_warps,
    )
    return drafts, num_valid
