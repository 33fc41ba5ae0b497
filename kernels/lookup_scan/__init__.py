"""Lookup (prompt-lookup / n-gram) drafting over request token histories.

Shape legend: B requests in the batch, R rows of the history buffer, S history capacity per row.
"""

from __future__ import annotations

import os

import torch

from kernels.lookup_scan import cuda
from kernels.lookup_scan.config import cuda_choice
from kernels.lookup_scan.reference import naive_lookup_scan
from kernels.lookup_scan.triton import lookup_scan_fwd, workspace_numel

__all__ = ["lookup_scan", "naive_lookup_scan", "workspace_numel"]


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
        out: optional (drafts [B, num_draft] int64, num_valid [B] int32).
        programs_per_request: grid width per request (default from S, capped); Triton kernel only.

    Returns:
        drafts: [B, num_draft] int64; slots past num_valid hold the request's last token.
        num_valid: [B] int32 proposed tokens (0: no match).

    Kernel: the CUDA cluster kernel where config.CUDA_RULE picks it for (B, S) and the call is
    supported (sm_90, int32 rows 16-byte aligned), else the Triton kernel; ``HH_LOOKUP_BACKEND``
    = auto (default) | triton | cuda overrides the rule.  Both give the reference's proposals.
    """
    if programs_per_request is None and token_ids.is_cuda:
        B = token_ids.shape[0] if req_indices is None else req_indices.shape[0]
        choice = cuda_choice(B, token_ids.shape[1], os.environ.get("HH_LOOKUP_BACKEND", "auto").lower())
        if choice is not None and cuda.supported(token_ids, seq_lens, req_indices, max_n, num_draft, choice[0]):
            return cuda.lookup_scan_cuda(token_ids, seq_lens, min_n, max_n, num_draft, req_indices, out, *choice)
    return lookup_scan_fwd(
        token_ids, seq_lens, min_n, max_n, num_draft, req_indices, workspace, out, programs_per_request
    )
