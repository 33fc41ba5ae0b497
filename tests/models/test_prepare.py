"""`models prepare` for the GPU profiles: int8 group-128 heads in compressed-tensors' pack-quantized
format, on the tiny hybrid model (the real Qwen3-Next tensor names, MTP included) and on synthetic
checkpoints where a case needs a shape the tiny model lacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from backend.models import heads, int8
from backend.models.cache import ModelPrepError, verify_manifest
from backend.models.prepare import INDEX, REPORT, STATE, ProgressSink, prepare_checkpoint
from backend.models.safetensors_io import read_header, read_tensor

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> Path:
    from backend.models import prepare_model

    return prepare_model("tiny-qwen-hybrid")


@pytest.fixture(scope="module")
def prepared_tiny(tiny, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prep") / "tiny"
    return out, prepare_checkpoint(tiny, out, heads.Recipe())


def _tensors(d: Path) -> dict[str, tuple[Path, object]]:
    return {n: (f, i) for f in sorted(d.glob("*.safetensors")) for n, i in read_header(f)[0].items()}


def _checkpoint(d: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(d / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (d / "config.json").write_text(json.dumps(config or {"torch_dtype": "bfloat16"}))
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _normal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16()


def test_int8_group128_roundtrip_has_no_clipping():
    w = torch.randn(300, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 0.02
    w[7, 3] = 0.5  # an outlier owns its group's scale; the others keep theirs
    w[9, :128] = 0  # an all-zero group dequantizes to exactly zero
    codes, scale = int8.quantize_rows(w, torch.bfloat16)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127
    assert scale.shape == (300, 4) and scale.dtype == torch.bfloat16
    # scales are rounded up to bf16: amax / scale never exceeds 127, so no code is clipped
    amax = w.float().reshape(300, 4, 128).abs().amax(-1)
    assert bool((amax / scale.float() <= 127).all())
    deq = int8.dequantize(codes, scale)
    assert bool((deq[9, :128] == 0).all())
    stats = int8.ErrorStats()
    stats.add(w, codes, scale, 128)
    assert 0.004 < stats.rel_error < 0.01  # the seeds' 0.56-0.64% for Gaussian-like weights
    assert int(codes[7].abs().max()) == 127


def test_our_packing_is_what_compressed_tensors_decompresses(prepared_tiny, tiny):
    """The library that defines the format (compressed-tensors' PackedQuantizationCompressor, with the
    scheme read back from the prepared config) decompresses our tensors to our dequantized weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out, report = prepared_tiny
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    got, src = _tensors(out), _tensors(tiny)
    for group in qc["config_groups"].values():
        scheme = QuantizationScheme.model_validate(group)
        for name in (n for n in report["tensors"] if heads.part_of(n)):
            base = name.removesuffix(".weight")
            if not any(__import__("re").match(t[3:], base) for t in group["targets"]):
                continue
            state = {k: read_tensor(*got[f"{base}.{k}"]) for k in ("weight_packed", "weight_scale", "weight_shape")}
            dense = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
            ours = int8.dequantize(int8.unpack(state["weight_packed"]), state["weight_scale"])
            assert torch.equal(dense, ours.to(state["weight_scale"].dtype).float()), name
            w = read_tensor(*src[name]).float()
            w, dense = w.double(), dense.double()
            assert float((dense - w).norm() / w.norm()) == pytest.approx(report["tensors"][name]["rel_error"], rel=1e-6)


def test_tiny_prepare_error_table_bound_and_untouched_tensors(prepared_tiny, tiny):
    out, report = prepared_tiny
    parts = {e["part"] for e in report["tensors"].values()}
    assert parts == {"lm_head", "embed_tokens", "mtp"}
    for name, e in report["tensors"].items():
        assert e["rel_error"] < 0.01, name
        assert e["prepared_bytes"] < e["source_bytes"] * 0.52, name  # int8 + bf16 scales per 128
    assert set(report["tensors"]) >= {"lm_head.weight", "model.embed_tokens.weight", "mtp.fc.weight",
                                      "mtp.layers.0.self_attn.q_proj.weight"}
    # the shared expert's down_proj has an input dim of 64: it cannot take group 128 and says so
    assert "group 128" in report["kept"]["mtp.layers.0.mlp.shared_expert.down_proj.weight"]
    src, got = _tensors(tiny), _tensors(out)
    for name, (f, info) in src.items():
        if name in report["tensors"]:
            base = name.removesuffix(".weight")
            assert name not in got
            assert {f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"} <= set(got)
            assert read_tensor(*got[f"{base}.weight_shape"]).tolist() == list(info.shape)
        else:  # everything else is carried byte for byte
            assert torch.equal(read_tensor(*got[name]), read_tensor(f, info)), name
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert index == {n: f.name for n, (f, _) in got.items()}
    assert verify_manifest(out, deep=True)
    assert json.loads((out / REPORT).read_text())["tensors"] == report["tensors"]
    assert not (out / STATE).exists()


def test_vllm_reads_the_groups_for_every_model_naming(prepared_tiny):
    """vLLM's CompressedTensorsConfig (the class the engine builds from config.json) gives each quantized
    module int8 group 128 symmetric, under the names of the Qwen3-Next / Qwen3.5 classes and the MTP
    drafter, and nothing to the modules left as they were."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    out, _ = prepared_tiny
    cfg = CompressedTensorsConfig.from_config(json.loads((out / "config.json").read_text())["quantization_config"])
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    module = torch.nn.Module()
    for name in ("lm_head", "language_model.lm_head", "model.embed_tokens", "language_model.model.embed_tokens",
                 "mtp.embed_tokens", "mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.self_attn.o_proj",
                 "mtp.layers.0.mlp.shared_expert.gate_up_proj"):
        w = cfg.get_scheme_dict(module, name)["weights"]
        assert (w.num_bits, w.group_size, w.symmetric, w.strategy) == (8, 128, True, "group"), name
    for name in ("model.layers.3.self_attn.qkv_proj", "mtp.layers.0.mlp.shared_expert.down_proj",
                 "model.layers.0.linear_attn.out_proj"):
        assert cfg.get_scheme_dict(module, name) is None, name


def test_ignore_entries_of_a_w4a16_checkpoint_are_narrowed_not_lost():
    """A W4A16 checkpoint's config (group_0 on every Linear, lm_head and the MTP block ignored): our
    groups join it, the ignore entries stop shadowing what we quantized and keep everything else."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    original = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": heads.group_scheme(128, ["Linear"]) | {
                    "weights": {**heads.group_scheme(128, [])["weights"], "num_bits": 4}}},
                "ignore": ["lm_head", "re:.*mtp.*", "re:.*visual.*"]}
    quantized = {"lm_head": ["lm_head"], "mtp": ["mtp.fc", "mtp.layers.0.self_attn.q_proj"]}
    qc = heads.quantization_config(original, quantized, heads.Recipe())
    assert "lm_head" not in qc["ignore"] and "re:.*visual.*" in qc["ignore"]
    cfg = CompressedTensorsConfig.from_config(qc)

    class ColumnParallelLinear(torch.nn.Module):  # matched by class name, as vLLM's own linears are
        pass

    linear = ColumnParallelLinear()
    bits = lambda n: (d := cfg.get_scheme_dict(linear, n)) and d["weights"].num_bits  # noqa: E731
    assert bits("lm_head") == 8 and bits("mtp.fc") == 8 and bits("mtp.layers.0.self_attn.q_proj") == 8
    assert bits("mtp.layers.0.mlp.down_proj") is None  # still ignored: not quantized by us
    assert bits("visual.blocks.0.attn.qkv") is None
    assert bits("model.layers.0.mlp.down_proj") == 4  # the checkpoint's own W4A16 group


def test_a_tensor_over_the_bound_is_refused_and_nothing_is_published(tmp_path):
    gen = torch.Generator().manual_seed(2)
    lm = torch.randn(256, 256, generator=gen) * 0.02
    lm[:, ::128] = 3.0  # one huge outlier per group: the other 127 values round to 0
    src = _checkpoint(tmp_path / "src", {
        "a.safetensors": {"model.embed_tokens.weight": (torch.randn(256, 256, generator=gen) * 0.02).bfloat16()},
        "b.safetensors": {"lm_head.weight": lm.bfloat16(), "model.norm.weight": torch.ones(256).bfloat16()},
    })
    with pytest.raises(ModelPrepError, match=r"lm_head\.weight: .* relative error .* >= the bound 1\.00%"):
        prepare_checkpoint(src, tmp_path / "out", heads.Recipe())
    assert not (tmp_path / "out").exists()
    staging = tmp_path / "out.partial"
    assert not (staging / "b.safetensors").exists() and not list(staging.glob("*.tmp"))
    # without lm_head in the recipe the same checkpoint prepares
    report = prepare_checkpoint(src, tmp_path / "out", heads.Recipe(parts=("embed_tokens",)))
    assert set(report["tensors"]) == {"model.embed_tokens.weight"}


class _Interrupt(ProgressSink):
    """Records the units a run does and skips; interrupts when told to start `stop_at`."""

    def __init__(self, stop_at: str | None = None) -> None:
        self.stop_at, self.started, self.skipped = stop_at, [], []

    def run(self, plan):
        import contextlib

        sink = self

        class Bars:
            def start(self, unit):
                if unit.shard == sink.stop_at:
                    raise KeyboardInterrupt
                sink.started.append(unit.shard)

            def skip(self, unit):
                sink.skipped.append(unit.shard)

            def advance(self, n):
                pass

        return contextlib.nullcontext(Bars())


def test_an_interrupted_run_resumes_without_redoing_finished_shards(tmp_path, tiny):
    gen = torch.Generator().manual_seed(3)
    src = _checkpoint(tmp_path / "src", {
        "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": _normal(512, 256, gen),
                                             "model.layers.0.x.weight": torch.randn(8, 8).bfloat16()},
        "model-00002-of-00003.safetensors": {"model.layers.1.x.weight": torch.randn(8, 8).bfloat16()},
        "model-00003-of-00003.safetensors": {"lm_head.weight": _normal(512, 256, gen)},
    })
    first = _Interrupt(stop_at="model-00003-of-00003.safetensors")
    with pytest.raises(KeyboardInterrupt):
        prepare_checkpoint(src, tmp_path / "out", heads.Recipe(), progress=first)
    assert first.started == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    second = _Interrupt()
    report = prepare_checkpoint(src, tmp_path / "out", heads.Recipe(), progress=second)
    assert second.skipped == first.started and second.started == ["model-00003-of-00003.safetensors"]
    # the untouched shard is a link to the source, not a copy
    shard = "model-00002-of-00003.safetensors"
    assert os.path.samefile(tmp_path / "out" / shard, src / shard)
    straight = prepare_checkpoint(src, tmp_path / "straight", heads.Recipe())
    files = lambda d: json.loads((d / "manifest.json").read_text())["files"]  # noqa: E731
    assert files(tmp_path / "out") == files(tmp_path / "straight")
    assert report["tensors"] == straight["tensors"]
    # a finished shard that no longer matches its record is redone, not trusted
    third = _Interrupt(stop_at="model-00003-of-00003.safetensors")
    with pytest.raises(KeyboardInterrupt):
        prepare_checkpoint(src, tmp_path / "again", heads.Recipe(), progress=third)
    with open(tmp_path / "again.partial" / "model-00001-of-00003.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    fourth = _Interrupt()
    prepare_checkpoint(src, tmp_path / "again", heads.Recipe(), progress=fourth)
    assert fourth.started[0] == "model-00001-of-00003.safetensors"
    assert files(tmp_path / "again") == files(tmp_path / "straight")


def test_peak_memory_is_a_chunk_not_a_tensor(tmp_path):
    """A 512 MiB checkpoint (two 256 MiB heads): the run's high-water mark stays within a quarter
    of one tensor above where it started."""
    res = subprocess.run([sys.executable, "-m", "tests.models.peak_memory", str(tmp_path), "--rows", "65536",
                          "--cols", "2048"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["checkpoint_bytes"] > 512 << 20
    assert m["run_peak_over_before"] < m["largest_tensor_bytes"] / 4, m
    assert all(e < 0.01 for e in m["rel_error"].values())


def test_models_prepare_profile_prints_the_table_and_is_idempotent(tmp_path, monkeypatch, tiny):
    from backend.cli import app

    monkeypatch.setenv("HYPERHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    profile = tmp_path / "tiny-gpu.yaml"
    profile.write_text(f"""
description: tiny-qwen-hybrid as a prepared GPU checkpoint
model: {{path: {tiny}, served_name: tiny, prepare: {{parts: [lm_head, embed_tokens, mtp]}}}}
engine: {{device: cuda, max_model_len: 4096, max_num_seqs: 1, max_num_batched_tokens: 2048,
          kv_cache_dtype: auto, enable_prefix_caching: true, enforce_eager: true, gpu_memory_utilization: 0.9}}
""")
    runner = CliRunner()
    first = runner.invoke(app, ["models", "prepare", "--profile", str(profile)], terminal_width=200)
    assert first.exit_code == 0, first.output
    for shown in ("lm_head.weight", "model.embed_tokens.weight", "peak RSS"):
        assert shown in first.output
    prepared = [d for d in (tmp_path / "cache" / "prepared").iterdir() if not d.name.startswith(".")]
    assert len(prepared) == 1 and verify_manifest(prepared[0])
    again = runner.invoke(app, ["models", "prepare", "--profile", str(profile)], terminal_width=200)
    assert again.exit_code == 0 and str(prepared[0]) in again.output.replace("\n", "")
    from backend.models import prepared as prep
    from backend.profiles import load_profile

    assert prep.require(load_profile(profile), tiny) == prepared[0]
