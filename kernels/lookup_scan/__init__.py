"""Lookup (prompt-lookup / n-gram) drafting over request token histories.

Shape legend: B requests in the batch, R rows of the history buffer, S history capacity per row.
"""

from __future__ import annotations

import torch

from kernels.lookup_scan.reference import naive_lookup_scan
from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel, zero_outputs

__all__ = ["lookup_scan", "naive_lookup_scan", "workspace_numel", "zero_outputs"]


def lookup_scan(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    min_n: int,
    max_n: int,
    num_draft: int,
    req_indices: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs_per_request: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose ``num_draft`` tokens per request from the longest recent suffix match (one launch).

    Same proposals as :func:`naive_lookup_scan`: the longest n in [min_n, max_n] whose suffix
    occurs earlier in the history, the most recent occurrence, the tokens that followed it.

    Args:
        token_ids: [R, S] int32/int64 history buffer (vLLM's ``all_token_ids`` layout); row r is
            valid up to seq_lens[r]; S < 2**26 (packed 32-bit score).
        seq_lens: [R] int history lengths.
        min_n, max_n: n-gram lengths, 1 <= min_n <= max_n <= 31.
        num_draft: k tokens to propose.
        req_indices: optional [B] int rows to serve (vLLM's ``idx_mapping``); default all R rows.
        workspace: optional contiguous int64 [workspace_numel(B)] zeros (used as int32 words; a
            longer one is fine); the kernel leaves it zeroed, so a persistent one makes the call
            CUDA-graph capturable with no memset.
        out: optional (drafts [B, num_draft] int64, num_valid [B] int32), persistent across calls:
            on entry they must hold values below the in-place fold's range (drafts < 2**58,
            num_valid < 2**26), i.e. zeros, negative fills or this function's previous proposals,
            as the kernel leaves them; not torch.empty garbage.  Default: fresh zeros.
        programs_per_request: grid width per request (default from S, capped).

    Returns:
        drafts: [B, num_draft] int64; slots past num_valid hold the request's last token.
        num_valid: [B] int32 proposed tokens (0: no match).
    """
    return lookup_scan_fwd(
        token_ids, seq_lens, min_n, max_n, num_draft, req_indices, workspace, out, programs_per_request
    )
