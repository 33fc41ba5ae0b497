"""Plain-torch specification of lookup (prompt-lookup / n-gram) drafting.

For a history h[0:L], find the longest n in [min_n, max_n] such that the suffix h[L-n:L] occurs
earlier, at a start p <= L-n-1 (overlap with the suffix allowed, the suffix itself excluded);
among matches of that length the most recent (largest p) wins.  Propose the k tokens that followed,
h[p+n : p+n+k], clipped at the end of the history; unused slots repeat the last token h[L-1].
This is vLLM 0.32.0's V2 n-gram speculator's rule (longest n, then rightmost position).
"""

from __future__ import annotations

import torch


def naive_lookup_scan(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    min_n: int,
    max_n: int,
    num_draft: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serial reference, one request at a time, n from long to short.

    token_ids: [B, S] int histories (row b valid up to seq_lens[b]); seq_lens: [B].
    Returns drafts: [B, num_draft] int64 and num_valid: [B] int32 (0 when nothing matched).
    """
    B = token_ids.shape[0]
    drafts = torch.zeros(B, num_draft, dtype=torch.int64)
    num_valid = torch.zeros(B, dtype=torch.int32)
    for i_b in range(B):
        L = int(seq_lens[i_b])
        h = token_ids[i_b, :L].to(torch.int64).cpu()
        drafts[i_b] = h[L - 1] if L > 0 else 0
        for n in range(max_n, min_n - 1, -1):
            if L < n + 1:
                continue
            windows = h[: L - 1].unfold(0, n, 1)  # starts 0 .. L-1-n
            hits = (windows == h[L - n :]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                nv = min(L - start, num_draft)
                drafts[i_b, :nv] = h[start : start + nv]
                num_valid[i_b] = nv
                break
    return drafts, num_valid
