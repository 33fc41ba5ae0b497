"""The embedded engines start from their profiles and answer; the hybrid one reports the pool geometry
our arithmetic predicts."""
from __future__ import annotations

import re

import httpx
import pytest

from backend.geometry import ModelShape, compute
from backend.profiles import load_profile

pytestmark = pytest.mark.engine


def test_smol_answers_a_real_question(smol_engine):
    r = httpx.post(
        f"{smol_engine.base_url}/v1/chat/completions",
        json={"model": smol_engine.model_name, "temperature": 0, "max_tokens": 12,
              "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        timeout=60,
    )
    r.raise_for_status()
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_hybrid_block_size_matches_geometry(hybrid_engine):
    metrics = httpx.get(f"{hybrid_engine.base_url}/metrics", timeout=10).text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    geom = compute(load_profile("cpu-hybrid"), ModelShape.from_model_dir(hybrid_engine.model_dir))
    assert int(labels["block_size"]) == geom.block_size
    assert labels["mamba_cache_mode"] == "align"
