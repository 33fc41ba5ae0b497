"""The harness's CPU side (run by tests/gpu/test_pack.py in a child process; prints JSON).

The child sees vLLM only from the unpacked archive and third-party packages only from a site
folder holding the device image's packages and the carried wheels (vllm_env.device_site), with
Python's own site-packages off (-S).  It installs the shims, imports every module the GPU
harness uses, then builds the rig at small shapes on the CPU platform: gpu-long's config through
vLLM's EngineArgs, vLLM's Attention (TRITON_ATTN) and GDN layers before and after the plugin's
`register()`, their KV-cache specs, groups, allocation and binding, and one verify step's
metadata from vLLM's builders.  Forward passes need the GPU (vLLM's Triton kernels are
placeholders on a CPU platform): tests/gpu/test_layers_gpu.py runs them on the H200.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

MODULES = (
    "vllm.config", "vllm.engine.arg_utils", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.ops.triton_unified_attention", "vllm.v1.kv_cache_interface",
    "vllm.model_executor.layers.attention.attention", "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.v1.attention.backends.gdn_attn", "vllm.compilation.cuda_graph", "vllm.v1.worker.mamba_utils",
    "vllm.v1.worker.utils", "vllm.v1.core.kv_cache_utils", "vllm.forward_context", "vllm.platforms.cuda",
    "vllm.model_executor.models.qwen3_next", "backend.plugin.gdn_layer", "backend.plugin.attention",
    "kernels.verify_attention", "kernels.gdn_verify",
)  # fmt: skip


def main() -> None:
    from tests.gpu.vllm_env import install_shims

    report: dict = {"shims": install_shims()}
    import vllm

    report["vllm_file"] = vllm.__file__
    report["vllm_version"] = importlib.metadata.version("vllm")
    report["compiled_extension"] = importlib.util.find_spec("vllm._C") is not None
    report["imports"] = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
            report["imports"][name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, asserted by the test
            report["imports"][name] = repr(exc)[:400]
    from tests.gpu import rig as r

    eng = r.Engine("gpu-long", max_model_len=int(os.environ.get("HH_CHECK_MAX_MODEL_LEN", "2048")))
    report["engine"] = r.describe(eng)
    off = r.Stack(eng, "off", attn=1, gdn=1, max_reqs=2, max_context=1024, seed=1)
    r.enable_plugin(require_attention_route=False)
    on = r.Stack(eng, "on", attn=1, gdn=1, max_reqs=2, max_context=1024, seed=1)
    report["stacks"] = {}
    for st in (off, on):
        st.assign_blocks(seed=3)
        step = r.StepInputs(context=[900, 700], tokens=[1 + eng.num_spec] * 2, num_accepted=[1, 3])
        md, slots, bd = st.set_batch(step)
        gdn_md = md[st.gdn_layers[0].prefix]
        attn_md = md[st.attn_layers[0].layer_name]
        report["stacks"][st.name] = {
            "gdn_class": type(st.gdn_layers[0]).__name__,
            "attention_backend": st.attn_layers[0].attn_backend.get_name(),
            "kv_groups": [type(g.spec).__name__ for g in st.groups],
            "attention_kv_shape": list(st.attn_layers[0].kv_cache.shape),
            "gdn_state_shapes": [list(t.shape) for t in st.gdn_layers[0].kv_cache],
            "num_spec_decodes": gdn_md.num_spec_decodes,
            "spec_state_indices": gdn_md.spec_state_indices_tensor.tolist(),
            "windows": [st.window(0, b) for b in range(2)],
            "num_accepted": gdn_md.num_accepted_tokens.tolist(),
            "attention_max_query_len": attn_md.max_query_len,
            "attention_seq_lens": attn_md.seq_lens.tolist(),
            "slot_mapping_ok": slots[st.attn_layers[0].layer_name].tolist()
            == st.slots(0, range(900, 908)) + st.slots(1, range(700, 708)),
            "batch_descriptor": [bd.num_tokens, bd.num_reqs, bd.uniform],
        }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    eng.close()


if __name__ == "__main__":
    main()
