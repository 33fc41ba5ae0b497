"""Lookup drafting fused with DFlash2 (the seeds' LABD), the part that is pure tensor logic.

vLLM 0.32.0 runs one speculator per config; DFlash2 fills `draft_tokens[B, k]` and pre-temperature
`draft_logits[max_reqs, k, V]` (the q of rejection sampling). Fusion overrides, per request, the
drafter's proposal with a lookup continuation (`kernels.lookup_scan` over the request's token
history, run with min_n = NSTRONG so only strong matches come back) and gives those positions a
point-mass q (logit 0 on the proposed id, -inf elsewhere): the rejection sampler then accepts a
lookup token with probability p(token), so the output distribution stays exactly the target's.

Wiring (GPU-only, not done here): `init_speculator` (v1/worker/gpu/spec_decode/__init__.py:13)
returns a `DFlash2Speculator` subclass whose `_generate_draft` calls the drafter, then
`lookup_scan` on `req_states.all_token_ids`, then `fuse_lookup_drafts` + `point_mass_`. No host
sync: everything below is branch-free tensor code, so it is also CUDA-graph capturable.
"""
from __future__ import annotations

import torch


def fuse_lookup_drafts(
    draft_tokens: torch.Tensor,
    lookup_tokens: torch.Tensor,
    lookup_valid: torch.Tensor,
    agree: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick, per request and position, the drafter's or the lookup's token.

    Args:
        draft_tokens: [B, k] int64, the drafter's proposal.
        lookup_tokens: [B, k] int64, the lookup continuation (from `lookup_scan`).
        lookup_valid: [B] int32 number of valid lookup tokens (0: no strong match).
        agree: take the lookup only where the drafter already proposed its first `agree` tokens
            (the seeds' AGREE; 0 trusts any strong match).

    Returns:
        tokens: [B, k] int64 fused proposal.
        from_lookup: [B, k] bool, positions that need a point-mass q.
    """
    if draft_tokens.shape != lookup_tokens.shape or draft_tokens.dim() != 2:
        shapes = f"draft {tuple(draft_tokens.shape)} and lookup {tuple(lookup_tokens.shape)}"
        raise ValueError(f"{shapes} must both be [B, k]")
    k = draft_tokens.shape[1]
    if not 0 <= agree <= k:
        raise ValueError(f"agree must be in [0, {k}], got {agree}")
    positions = torch.arange(k, device=draft_tokens.device)
    valid = positions[None, :] < lookup_valid[:, None].to(positions.dtype)
    use = lookup_valid > 0
    if agree:
        head_matches = (draft_tokens[:, :agree] == lookup_tokens[:, :agree]).all(dim=1)
        use = use & head_matches & (lookup_valid >= agree)
    from_lookup = valid & use[:, None]
    return torch.where(from_lookup, lookup_tokens, draft_tokens), from_lookup


def point_mass_(
    draft_logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    from_lookup: torch.Tensor,
) -> torch.Tensor:
    """In place: q = one-hot(token) at the positions taken from the lookup.

    Args:
        draft_logits: [R, k, V] float pre-temperature logits (R request-state rows).
        rows: [B] int64 request-state row of each batch request (vLLM's idx_mapping).
        tokens: [B, k] int64 fused proposal.
        from_lookup: [B, k] bool.
    """
    sub = draft_logits[rows]  # [B, k, V] copy
    one_hot = torch.full_like(sub, float("-inf"))
    one_hot.scatter_(2, tokens.unsqueeze(-1), 0.0)
    draft_logits[rows] = torch.where(from_lookup.unsqueeze(-1), one_hot, sub)
    return draft_logits
