"""The MTP drafter's vocabulary: chosen from the model's own outputs on the shipped prompts (real
engines: SmolLM2-135M with real weights for a coverage that means something, tiny-qwen-hybrid for the
Qwen vocabulary, its specials and the whole `models draft-vocab` flow), baked into a prepared
checkpoint, and used by vLLM's MTP drafter through patch 0008."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from backend.models import draft_vocab as dv
from backend.models.cache import verify_manifest
from backend.models.safetensors_io import read_header, read_tensor

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_choose_takes_every_special_then_the_most_frequent_to_exactly_size():
    counts = Counter({5: 50, 6: 40, 7: 40, 8: 1, 900: 30})
    ids = dv.choose(counts, specials=[1000, 1001], size=64, vocab_size=2000)
    # fewer distinct ids than the size: all of them, then the lowest unseen ids up to exactly 64
    assert len(ids) == 64 and ids == sorted(ids) and {5, 6, 7, 8, 900, 1000, 1001} <= set(ids)
    assert set(ids) - {5, 6, 7, 8, 900, 1000, 1001} == set(range(61)) - {5, 6, 7, 8}
    many = Counter({i: 1000 - i for i in range(500)})
    ids = dv.choose(many, specials=[7000, 7001, 3], size=128, vocab_size=8000)
    assert len(ids) == 128 and {7000, 7001, 3} <= set(ids)
    assert set(ids) - {7000, 7001} == set(range(126))  # 3 is both special and frequent: counted once
    with pytest.raises(ValueError, match="multiple of 64"):
        dv.choose(many, [], 100, 8000)
    outputs = [dv.Output("a", (1, 2, 3, 4)), dv.Output("b", (4, 4, 9, 9))]
    assert dv.coverage({4, 9}, outputs) == 5 / 8


@pytest.mark.unit
def test_the_shipped_prompt_set_splits_nine_to_one():
    prompts = dv.load_prompts("agent")
    ids = [p["id"] for p in prompts]
    assert len(ids) == len(set(ids)) >= 200
    held = [i for i in ids if dv.held_out(i)]
    assert 0.05 < len(held) / len(ids) < 0.15
    assert {p["kind"] for p in prompts} >= {"code", "agent", "prose", "structured", "math", "multilingual"}


@pytest.mark.engine
def test_smollm2_own_outputs_cover_its_held_out_outputs_better_than_rank_order(smol_engine):
    """Real weights, real outputs: the vocabulary counted from nine tenths of the prompts covers more of
    what the model writes for the held-out tenth than the same number of ids in BPE rank order (the
    tokenizer's own, corpus-frequency order: what a vocabulary not counted from the model gives)."""
    # every held-out prompt, half of the counted ones (CI time; the full set's figures are
    # tests/models/draft_vocab_coverage.py's, in docs/models-gpu.md)
    prompts = [p for i, p in enumerate(dv.load_prompts("agent")) if dv.held_out(p["id"]) or i % 2 == 0]
    outputs = dv.collect(smol_engine.base_url, smol_engine.model_name, prompts, max_tokens=48, concurrency=8)
    specials, vocab_size = dv.special_ids(smol_engine.model_dir), dv.vocab_size_of(smol_engine.model_dir)
    vocab = dv.build(outputs, specials, 2048, vocab_size, {"model": "smollm2-135m"})
    rank_order = set(dv.choose(Counter(), specials, 2048, vocab_size))
    held = [o for o in outputs if dv.held_out(o.prompt_id)]
    baseline = dv.coverage(rank_order, held)
    print("\nDRAFT-VOCAB " + json.dumps({**{k: vocab[k] for k in ("size", "prompts", "tokens", "distinct_ids_counted",
                                                                   "coverage")}, "rank_order_held_out": baseline}))
    assert vocab["size"] == 2048 and set(specials) <= set(vocab["ids"])
    assert vocab["tokens"]["held_out"] > 500
    assert vocab["coverage"]["counted"] > vocab["coverage"]["held_out"] > baseline + 0.05


@pytest.mark.engine
def test_draft_vocab_command_gives_the_prepared_checkpoint_its_drafter_head(hybrid_engine, tmp_path, monkeypatch):
    """`models prepare` + `models draft-vocab` for a profile serving tiny-qwen-hybrid with an MTP drafter:
    the prepared copy gets `mtp.draft_lm_head` (the vocabulary's rows of the int8 lm_head) and the MTP
    drafter in vLLM drafts only from it, without changing a greedy output."""
    from backend.cli import app

    monkeypatch.setenv("HYPERHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    profile = tmp_path / "tiny-mtp.yaml"
    profile.write_text(f"""
description: tiny-qwen-hybrid, prepared, with an MTP drafter over a draft vocabulary
model:
  path: {hybrid_engine.model_dir}
  served_name: {hybrid_engine.model_name}
  prepare: {{parts: [lm_head, embed_tokens, mtp], draft_vocab: {{size: 1024, max_tokens: 32}}}}
engine: {{device: cuda, max_model_len: 4096, max_num_seqs: 1, max_num_batched_tokens: 2048, kv_cache_dtype: auto,
          enable_prefix_caching: true, enforce_eager: true, gpu_memory_utilization: 0.9,
          speculative: {{method: mtp, num_speculative_tokens: 2}}}}
""")
    runner = CliRunner()
    res = runner.invoke(app, ["models", "prepare", "--profile", str(profile)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["models", "draft-vocab", "--profile", str(profile), "--base-url", hybrid_engine.base_url,
                              "--concurrency", "4"])
    assert res.exit_code == 0, res.output
    assert "coverage of the held-out outputs" in res.output
    from backend.models import prepared
    from backend.profiles import load_profile

    served = prepared.require(load_profile(profile), hybrid_engine.model_dir)
    assert served.name.endswith("-dv1024-agent") and verify_manifest(served, deep=True)
    vocab = json.loads((served / "draft_vocab.json").read_text())
    config = json.loads((served / "config.json").read_text())
    assert config["mtp_draft_vocab_size"] == len(vocab["ids"]) == 1024
    assert set(dv.special_ids(served)) <= set(vocab["ids"]) and len(vocab["specials"]) == 33
    tensors = {n: (f, i) for f in served.glob("*.safetensors") for n, i in read_header(f)[0].items()}
    ids = torch.tensor(vocab["ids"])
    for part in ("weight_packed", "weight_scale"):
        full = read_tensor(*tensors[f"lm_head.{part}"])
        assert torch.equal(read_tensor(*tensors[f"mtp.draft_lm_head.{part}"]), full[ids])
    assert torch.equal(read_tensor(*tensors["mtp.draft_vocab_ids"]), ids)
    # vLLM's MTP drafter on it (child process: in-process engine, CPU)
    child = subprocess.run([sys.executable, "-m", "tests.models.mtp_draft_vocab", str(served)], cwd=ROOT,
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["draft_head_method"] == "CompressedTensorsLinearMethod" and got["vocab_ids"] == vocab["ids"]
    assert got["counters"]["vllm:spec_decode_num_draft_tokens"] > 0 and got["drafted"]
    vocab_ids = set(vocab["ids"])
    for argmax, finite in got["drafted"]:
        assert all(t in vocab_ids for t in argmax) and set(finite) == {1024}
    # Greedy speculation is lossless: the outputs agree token for token, except that a random-weight
    # model has near-ties that bf16 verify (T=3) and decode (T=1) may break differently (seen: 0.008
    # nats apart, one bf16 step of the logits). From a divergence on, the two continue different texts.
    spec, plain = got["spec"], got["plain"]
    first = next((i for i, (a, b) in enumerate(zip(spec, plain, strict=True)) if a != b), None)
    if first is not None:
        top = got["plain_top"][first]
        assert first > 0 and str(spec[first]) in top, (first, spec[first], top)
        assert top[str(plain[first])] - top[str(spec[first])] < 0.05, (first, spec[first], top)
