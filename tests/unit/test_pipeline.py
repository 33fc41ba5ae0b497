"""gpu-pp2: the stage split and per-stage pools against vLLM 0.32's own functions, the dry run printing
both stages, the boot check refusing it on fewer cards, and the weights (prepared sizes) each card holds."""
from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from backend import geometry, pipeline
from backend.geometry import ModelShape, NotEnoughGpus, PoolDoesNotFit, block_view, check, compute
from backend.models.safetensors_io import read_header
from backend.profiles import load_profile
from backend.weights import from_checkpoint

pytestmark = pytest.mark.unit
QWEN27 = ModelShape.named("qwen3.8-27b")
GiB = 1 << 30


@pytest.mark.parametrize("layers, size, partition", [(64, 2, None), (63, 2, None), (64, 3, None), (65, 4, None),
                                                     (64, 2, "34,30"), (4, 2, None)])
def test_stage_split_is_vllms(monkeypatch, layers, size, partition):
    from vllm.distributed.utils import get_pp_indices  # reads VLLM_PP_LAYER_PARTITION from the environment

    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    else:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    ours = pipeline.stage_layers(layers, size, partition)
    assert ours == [get_pp_indices(layers, r, size) for r in range(size)]


@pytest.mark.parametrize("partition", [None, "34,30"])
def test_stage_block_ids_are_vllms_projected_groups(partition):
    """vLLM forms the KV-cache groups over the whole model and projects them onto each stage; a block id
    on a stage costs its fullest projected group. Built here with vLLM's own functions on real specs."""
    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), page_size_padded=attn.page_size_bytes)
    kinds = QWEN27.attention_map()
    specs = {f"model.layers.{i}.x": attn if a else gdn for i, a in enumerate(kinds)}
    groups = u._get_kv_cache_groups_uniform_page_size(specs)
    stages = pipeline.stage_layers(len(kinds), 2, partition)
    a, g, _ = geometry.kv_groups(QWEN27.attn_layers, QWEN27.gdn_layers)
    ours = pipeline.pool(stages=stages, attention=kinds, page_bytes=attn.page_size_bytes, block_size=16,
                         slots_per_seat=9, seats=1, max_model_len=4096, budget_bytes=GiB, drafter_bytes_per_seat=0,
                         attn_groups=a, gdn_groups=g, stage_weights=[None, None])
    assert len(groups) == a + g
    for stage, (s, e) in zip(ours.stages, stages, strict=True):
        worker = {n: sp for n, sp in specs.items() if s <= int(n.split(".")[2]) < e}
        projected = u._project_kv_cache_groups_to_worker(groups, worker)
        assert stage.group_layers == max(len(gr.layer_names) for gr in projected)


def test_gpu_pp2_halves_what_a_block_id_costs_each_card():
    pp2, long = load_profile("gpu-pp2"), load_profile("gpu-long")
    g2, g1 = compute(pp2, QWEN27), compute(long, QWEN27)
    assert g2.gpus_needed == 2 and g1.gpus_needed == 1 and g1.pipeline is None
    assert [(s.start, s.end, s.attn_layers, s.gdn_layers, s.drafter) for s in g2.pipeline.stages] == [
        (0, 32, 8, 24, False), (32, 64, 8, 24, True)]
    one = block_view(g1)
    two = block_view(g2)
    # the interleaved groups put half of every group on each stage: a block id costs a card half
    assert two.block_bytes * 2 == one.block_bytes
    assert two.pool_blocks == g2.pipeline.blocks == min(s.blocks for s in g2.pipeline.stages)
    assert g2.pipeline.fits and g2.fits
    assert two.pool_blocks * g2.block_size >= pp2.engine.max_model_len * 2  # room for both seats at 256K


def test_boot_check_refuses_pp2_on_one_card_naming_the_count(monkeypatch):
    g = compute(load_profile("gpu-pp2"), QWEN27)
    with pytest.raises(NotEnoughGpus, match=r"over 2 GPUs, and this machine shows 1 GPU \("):
        check(g, visible_gpus=1)
    with pytest.raises(PoolDoesNotFit, match="shows 0 GPUs"):  # a NotEnoughGpus is a PoolDoesNotFit to callers
        check(g, visible_gpus=0)
    check(g, visible_gpus=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what vLLM would see: one card
    with pytest.raises(NotEnoughGpus, match="shows 1 GPU"):
        check(g)
    check(compute(load_profile("gpu-long"), QWEN27), visible_gpus=0)  # one-card profiles: not counted here


def test_serve_refuses_pp2_on_this_machine(monkeypatch, tmp_path):
    """`serve` (not a dry run) stops at the boot check, before starting anything, naming the count."""
    from backend.cli import app

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    profile = tmp_path / "pp2.yaml"  # gpu-pp2 pointed at a local checkpoint, so nothing downloads
    text = (geometry.SHAPES_DIR.parent / "gpu-pp2.yaml").read_text()
    tiny = tmp_path / "ckpt"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps({
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 5120,
        "num_hidden_layers": 64, "full_attention_interval": 4, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16", "mamba_ssm_dtype": "float32"}))
    text = text.replace("  hf_repo: dbirks/Qwen3.8-27B-W4A16-AutoRound\n", f"  path: {tiny}\n")
    text = re.sub(r"  prepare:.*\n    parts: .*\n", "", text)
    profile.write_text(text)
    res = CliRunner().invoke(app, ["serve", "--profile", str(profile), "--no-key", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "pipeline parallel over 2 GPUs, and this machine shows 1 GPU" in " ".join(res.output.split())
    assert not (tmp_path / "run" / "logs").exists()  # no engine was started


def test_dry_run_prints_both_stages():
    from backend.cli import app

    res = CliRunner().invoke(app, ["serve", "--profile", "gpu-pp2", "--dry-run"], terminal_width=200,
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = res.output
    assert "--pipeline-parallel-size 2" in out
    for stage in ("stage 0 (GPU 0)", "stage 1 (GPU 1)"):
        assert stage in out
    assert "layers 0-31: 8 attention + 24 GDN" in out and "layers 32-63: 8 attention + 24 GDN + the drafter" in out
    assert re.search(r"pool \(the smallest stage's count\)\s*│\s*746 block ids × 864 tokens", out)


def test_weights_by_stage_and_the_prepared_sizes_decide_the_card(tmp_path):
    """The card check counts the checkpoint as it will be served: the tiny model does not fit a card
    sized for its prepared copy until it is prepared."""
    from backend.models import heads, prepare_model
    from backend.models.prepare import prepare_checkpoint

    tiny = prepare_model("tiny-qwen-hybrid")
    w = from_checkpoint(tiny)
    all_bytes = sum(i.nbytes for f in tiny.glob("*.safetensors") for i in read_header(f)[0].values())
    assert w.total + w.mtp == all_bytes and len(w.layers) == 4 and w.mtp > 0
    assert w.stage(0, 2, first=True, last=False) + w.stage(2, 4, first=False, last=True) == w.total + w.embed
    prepared = tmp_path / "prep"
    prepare_checkpoint(tiny, prepared, heads.Recipe(parts=("lm_head", "embed_tokens")))
    wp = from_checkpoint(prepared)
    assert wp.embed < w.embed * 0.52 and wp.head < w.head * 0.52 and wp.layers == w.layers
    profile = load_profile("cpu-hybrid")
    eng = profile.engine.model_copy(update={"device": "cuda", "kv_cache_memory_bytes": 64 << 20,
                                            "gpu_memory_utilization": 0.5, "cpu_kvcache_space_gib": None})
    mem = profile.memory.model_copy(update={"device_memory_gib": (w.total - 40 * (1 << 20) + (64 << 20)) * 2 / GiB})
    gpu_profile = profile.model_copy(update={"engine": eng, "memory": mem})
    shape = ModelShape.from_model_dir(tiny)
    before = compute(gpu_profile, shape, weights=w)
    after = compute(gpu_profile, shape, weights=wp)
    assert not before.fits and after.fits
    with pytest.raises(PoolDoesNotFit, match="prepare the checkpoint"):
        check(before)
    check(after)
    assert dict(before.describe())["GPU memory"].endswith("DOES NOT FIT")


def test_the_boot_check_reads_the_served_checkpoint_from_disk_prepared_or_not(tmp_path, monkeypatch):
    """Without weights passed, compute() counts what the profile would serve: the download until it is
    prepared, then the prepared copy (its int8 heads), so preparing is what makes this card fit."""
    from backend.models import prepare_model
    from backend.models.prepared import prepare_profile

    tiny = prepare_model("tiny-qwen-hybrid")
    monkeypatch.setenv("HYPERHARNESS_CACHE", str(tmp_path / "cache"))  # the prepared copy goes here
    w = from_checkpoint(tiny)
    pin = 64 << 20
    text = f"""
description: tiny-qwen-hybrid on a small card
model: {{path: {tiny}, served_name: tiny, prepare: {{parts: [lm_head, embed_tokens]}}}}
engine: {{device: cuda, max_model_len: 4096, max_num_seqs: 1, max_num_batched_tokens: 2048, kv_cache_dtype: auto,
          mamba_ssm_cache_dtype: bfloat16, enable_prefix_caching: true, enforce_eager: true,
          gpu_memory_utilization: 0.5, kv_cache_memory_bytes: {pin}}}
memory: {{device_memory_gib: {(w.total - (40 << 20) + pin) * 2 / GiB}}}
"""
    path = tmp_path / "tiny-card.yaml"
    path.write_text(text)
    profile = load_profile(path)
    shape = ModelShape.from_model_dir(tiny)
    before = compute(profile, shape)
    assert before.cards[0].weight_bytes == w.total and not before.fits
    prepare_profile(profile, download=False)
    after = compute(profile, shape)
    assert after.cards[0].weight_bytes < w.total * 0.55 and after.fits  # both 248,320-row heads in int8
    check(after)
