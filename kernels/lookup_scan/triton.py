"""Triton lookup-drafting scan: one launch, many programs per request, atomic-max fold.

Instead of testing every n in [min_n, max_n] at every start position (vLLM's scan: sum(n) loads per
position), each program walks candidate *end* positions e <= L-2 and measures the backward match
length m(e) = #{j < max_n : h[e-j] == h[L-1-j] for all smaller j}.  A match of length n starts at
e-n+1 and the draft begins at e+1 whatever n is, so the packed score (min(m, max_n) << 32 | e+1)
maximised over e gives the longest n and then the most recent position, exactly the serial rule.
Most positions fail the first compare, so chunks without a single last-token hit skip the rest.

Programs fold their chunk maxima into a per-request int64 with ``atomic_max``; the last program of a
request (an acq_rel ``atomic_add`` ticket) reads the result, resets the two workspace words to zero
and gathers the draft, so one graph-capturable launch does the whole lookup.  The grid depends on the
history capacity only; programs stride over the actual length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions per program iteration (4 per thread at 4 warps) and programs per batch: tuned on the
# H200 (kernels/lookup_scan/bench.py --sweep); the grid is sized by the history capacity, not the
# current length, so it can be captured in a CUDA graph.
BLOCK = 512
PROGRAMS_PER_BATCH = 1024


@triton.jit
def lookup_scan_kernel(
    tokens, s_tok, req_idx, seq_lens, drafts, num_valid, ws,
    P, B,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, K_DRAFT: tl.constexpr, KP: tl.constexpr,
    BLOCK: tl.constexpr, HAS_REQ_IDX: tl.constexpr,
):
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    row = tl.load(req_idx + i_b).to(tl.int64) if HAS_REQ_IDX else i_b.to(tl.int64)
    L = tl.load(seq_lens + row).to(tl.int64)
    p_h = tokens + row * s_tok
    last = tl.load(p_h + L - 1, mask=L > 0, other=0)

    best = tl.zeros((), dtype=tl.int64)
    o_e = tl.arange(0, BLOCK)
    for c in range(i_p, tl.cdiv(L - 1, BLOCK), P):
        e = c * BLOCK + o_e
        alive = e <= L - 2
        alive = alive & (tl.load(p_h + e, mask=alive, other=0) == last)
        if tl.max(alive.to(tl.int32)) > 0:
            m = alive.to(tl.int32)
            for j in tl.static_range(1, MAX_N):
                s_j = tl.load(p_h + L - 1 - j, mask=L - 1 - j >= 0, other=0)
                alive = alive & (e >= j)
                alive = alive & (tl.load(p_h + e - j, mask=alive, other=0) == s_j)
                m += alive.to(tl.int32)
            score = tl.where(m >= MIN_N, (m.to(tl.int64) << 32) | (e + 1).to(tl.int64), 0)
            best = tl.maximum(best, tl.max(score))

    if best > 0:  # most programs of a quoting history find nothing: spare the contended word
        tl.atomic_max(ws + i_b, best)
    ticket = tl.atomic_add(ws + B + i_b, 1)  # acq_rel: orders the max above before it
    if ticket == P - 1:
        best = tl.atomic_xchg(ws + i_b, 0)
        tl.atomic_xchg(ws + B + i_b, 0)
        start = best - ((best >> 32) << 32)  # e + 1 of the winning end position
        nv = tl.where(best > 0, tl.minimum(L - start, K_DRAFT), 0)
        o_d = tl.arange(0, KP)
        tok = tl.load(p_h + start + o_d, mask=o_d < nv, other=0)
        out = tl.where(o_d < nv, tok, last).to(tl.int64)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; see kernels.lookup_scan.lookup_scan for the contract."""
    if not 1 <= min_n <= max_n or max_n > 31 or num_draft < 1:
        raise ValueError(f"need 1 <= min_n <= max_n <= 31 and num_draft >= 1, got {min_n}, {max_n}, {num_draft}")
    if token_ids.stride(-1) != 1 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_ids must be int32/int64 with unit last stride, got {token_ids.dtype} {token_ids.stride()}")
    if token_ids.shape[1] >= 2**31:
        raise ValueError(f"history capacity {token_ids.shape[1]} exceeds the packed score")
    B = token_ids.shape[0] if req_indices is None else req_indices.shape[0]
    dev = token_ids.device
    if workspace is None:
        workspace = torch.zeros(2 * B, dtype=torch.int64, device=dev)
    elif workspace.shape != (2 * B,) or workspace.dtype != torch.int64:
        raise ValueError(f"workspace must be int64 [{2 * B}] zeros, got {workspace.dtype} {tuple(workspace.shape)}")
    drafts, num_valid = out if out is not None else (
        torch.empty(B, num_draft, dtype=torch.int64, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
    )
    P = programs_per_request or max(1, min(triton.cdiv(token_ids.shape[1], block), max(32, PROGRAMS_PER_BATCH // B)))
    lookup_scan_kernel[(P, B)](
        token_ids, token_ids.stride(0), req_indices if req_indices is not None else seq_lens, seq_lens,
        drafts, num_valid, workspace, P, B,
        MIN_N=min_n, MAX_N=max_n, K_DRAFT=num_draft, KP=triton.next_power_of_2(num_draft),
        BLOCK=block, HAS_REQ_IDX=req_indices is not None, num_warps=4,
    )
    return drafts, num_valid
