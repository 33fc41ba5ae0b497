from __future__ import annotations

import pytest
from typer.testing import CliRunner

from backend.cli import app
from backend.launcher import engine_argv
from backend.profiles import ProfileError, available_profiles, load_profile

pytestmark = pytest.mark.unit


def test_all_shipped_profiles_validate():
    names = available_profiles()
    assert {"cpu-smol", "cpu-hybrid", "gpu-fast", "gpu-long", "gpu-huge"} <= set(names)
    for n in names:
        load_profile(n)


def _write(tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


BASE = """
description: test
model: {embedded: smollm2-135m, served_name: s}
engine:
  device: cpu
  max_model_len: 4096
  max_num_seqs: 2
  max_num_batched_tokens: 2048
  kv_cache_dtype: auto
  enable_prefix_caching: true
  enforce_eager: true
"""


def test_unknown_keys_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="max_num_seq"):
        load_profile(_write(tmp_path, BASE + "  max_num_seq: 3\n"))


def test_per_token_head_cache_needs_triton_attn(tmp_path):
    text = BASE.replace("kv_cache_dtype: auto", "kv_cache_dtype: int8_per_token_head")
    with pytest.raises(ProfileError, match="TRITON_ATTN"):
        load_profile(_write(tmp_path, text))


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ProfileError, match="cpu-smol"):
        load_profile("no-such-profile")


def test_gpu_long_argv_is_explicit():
    argv = engine_argv(load_profile("gpu-long"), "/m", 8100, python="python")
    joined = " ".join(argv)
    for flag in ("--kv-cache-dtype int8_per_token_head", "--attention-backend TRITON_ATTN", "--host 127.0.0.1",
                 "--max-num-seqs 2", "--mamba-cache-mode align", "--enable-prefix-caching",
                 '"num_speculative_tokens":7'):
        assert flag in joined
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_dry_run_prints_argv_and_geometry_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["serve", "--profile", "gpu-long", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "--kv-cache-dtype int8_per_token_head" in result.output
    assert "33,280 B" in result.output and "fits" in result.output
    assert not (tmp_path / "hyperharness" / "api_key").exists()  # a dry run writes no key
