"""vLLM 0.32's layer stack for one engine step, built with vLLM's own code but no model runner.

What an engine builds between its flags and the first forward, done by the same functions:
the `VllmConfig` from a profile's engine flags (`backend.launcher.engine_argv`, parsed by
vLLM's `EngineArgs`), the platform's block-size alignment for hybrid models, single-process
distributed state, vLLM's own `Attention` (TRITON_ATTN) and `QwenGatedDeltaNetAttention`
layers with seeded random weights, their KV-cache specs, `get_kv_cache_configs`, the KV-cache
layout, `allocate_kv_cache` + `bind_kv_cache`, the metadata builders
(`TritonAttentionMetadataBuilder`, `GDNAttentionMetadataBuilder`) over persistent input buffers,
`set_forward_context` and `CUDAGraphWrapper` in FULL mode (warm-up, capture, replay as the
runner does for uniform spec-decode batches).  What the runner does around it (scheduling,
sampling, align-mode copies) is the caller's: `Stack.set_batch` takes the scheduler's decisions.

Differences from a served gpu-long engine, by construction: the drafter is `ngram_gpu` with the
profile's k (DFlash2 needs its weights; only k reaches these layers), projections are bf16
(W4A16 Marlin kernels are compiled ops), and no torch.compile (FULL graphs do not use it).

Legend: B requests, T tokens per request this step (1 + drafts), N = B * T, L context length.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.geometry import ModelShape
from backend.launcher import engine_argv
from backend.profiles import load_profile

HIDDEN_SIZE = 5120  # Qwen3.5/3.8-27B (shared/research/kernels.md: hidden 5120)
Q_HEADS = 24  # configs/shapes/qwen3.8-27b.yaml: "24 Q / 4 KV heads x 256" (the shape file has no Q count)
TOTAL_LAYERS = 64  # every 4th layer full attention (configs/shapes/qwen3.8-27b.yaml)


def is_attention_layer(index: int) -> bool:
    return index % 4 == 3


def write_model_dir(shape: ModelShape, dest: Path) -> Path:
    """A config-only model folder with the real head counts (vLLM reads only config.json)."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN_SIZE, num_attention_heads=Q_HEADS, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, linear_num_key_heads=shape.gdn_k_heads, linear_num_value_heads=shape.gdn_v_heads,
        linear_key_head_dim=shape.gdn_k_dim, linear_value_head_dim=shape.gdn_v_dim,
        linear_conv_kernel_dim=shape.conv_kernel, num_hidden_layers=TOTAL_LAYERS,
        layer_types=["full_attention" if is_attention_layer(i) else "linear_attention" for i in range(TOTAL_LAYERS)],
        intermediate_size=256, moe_intermediate_size=64, num_experts=2, num_experts_per_tok=1, mlp_only_layers=[],
        vocab_size=1024, max_position_embeddings=262144, torch_dtype=shape.model_dtype,
    )  # fmt: skip
    cfg.architectures = ["Qwen3NextForCausalLM"]
    dest.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(dest)
    return dest


def engine_config(profile_name: str, model_dir: Path, max_model_len: int):
    """The profile's engine flags through vLLM's own EngineArgs (server-only flags dropped)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile(profile_name)
    argv = engine_argv(profile, model_dir, port=0)[3:]  # drop "python -m module"
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns, _server_only = parser.parse_known_args(argv)
    args = EngineArgs.from_cli_args(ns)
    spec = profile.engine.speculative
    if spec is not None:
        # Only num_speculative_tokens reaches the layers; ngram_gpu needs no drafter weights.
        args.speculative_config = {"method": "ngram_gpu", "num_speculative_tokens": spec.num_speculative_tokens,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    args.skip_tokenizer_init = True
    args.reasoning_parser = ""  # a serving feature; it needs the tokenizer
    args.max_model_len = max_model_len
    return args.create_engine_config()


# The switches a gpu-long engine needs for our kernels (backend/plugin/__init__.py); engine auth
# and LABD concern the API server and the drafter, not these layers.
PLUGIN_ENV = {"HYPERHARNESS_PLUGIN": "1", "HYPERHARNESS_ENGINE_AUTH": "0", "HYPERHARNESS_VERIFY_ATTN": "1",
              "HYPERHARNESS_GDN_LAZY": "1", "HYPERHARNESS_LABD": "0"}
_UPSTREAM_ATTENTION: list = []  # vLLM's unified_attention, saved before the plugin rebinds it
_PLUGIN_ON = [False]


def enable_plugin(require_attention_route: bool = True) -> None:
    """What vLLM's plugin loader does in each worker: `backend.plugin.register()` under the
    plugin's switches.  Stacks built afterwards get the plugin's GDN layer; attention calls are
    routed by the binding in force when they run or are captured (`attention_route`).  Without
    CUDA the plugin leaves attention upstream (``require_attention_route=False`` accepts that)."""
    from vllm.v1.attention.backends import triton_attn

    if not _UPSTREAM_ATTENTION:
        _UPSTREAM_ATTENTION.append(triton_attn.unified_attention)
    os.environ.update(PLUGIN_ENV)
    from backend.plugin import register

    register()
    _PLUGIN_ON[0] = True
    if require_attention_route and not getattr(triton_attn.unified_attention, "hyperharness", False):
        raise RuntimeError("backend.plugin.register() did not route TRITON_ATTN (no CUDA device?)")


@contextmanager
def attention_route(plugin: bool):
    """Bind TRITON_ATTN's `unified_attention` as an engine with / without the plugin has it."""
    from vllm.v1.attention.backends import triton_attn

    current = triton_attn.unified_attention
    if not getattr(current, "hyperharness", False):  # no router installed: nothing to switch
        yield
        return
    triton_attn.unified_attention = current if plugin else _UPSTREAM_ATTENTION[0]
    try:
        yield
    finally:
        triton_attn.unified_attention = current


class Engine:
    """One process's vLLM state: config, platform block size, distributed groups, device."""

    def __init__(self, profile: str = "gpu-long", *, max_model_len: int = 100_352, workdir: Path | None = None) -> None:
        from tests.gpu.vllm_env import install_shims

        self.shims = install_shims()  # before vLLM's first import; none where a real build is installed
        from vllm.config import set_current_vllm_config

        self.shape = ModelShape.named(load_profile(profile).model.shape)
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="hh-rig-"))
        self.model_dir = write_model_dir(self.shape, self.workdir / "model")
        self.config = engine_config(profile, self.model_dir, max_model_len)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._ctx = set_current_vllm_config(self.config)
        self._ctx.__enter__()
        _init_distributed(self.config)
        self.block_size_aligned = False
        self.num_spec = self.config.speculative_config.num_speculative_tokens if self.config.speculative_config else 0
        self.dtype = self.config.model_config.dtype
        self.hf_config = self.config.model_config.hf_text_config

    @property
    def block_size(self) -> int:
        return self.config.cache_config.block_size

    def align_block_size(self) -> None:
        """The executor's step after loading the model: the platform picks the attention block
        for the backends of the registered layers and, for a hybrid model, grows it until a page
        holds a GDN state page (platforms/interface.py `_align_hybrid_block_size`).  Once."""
        from vllm.platforms import current_platform

        if not self.block_size_aligned:
            current_platform.update_block_size_for_backend(self.config)
            self.block_size_aligned = True

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)


def _init_distributed(config) -> None:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    port = _free_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", backend=backend)
    ps.initialize_model_parallel(1, 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """One KV-cache group of a stack: its layers, spec, builder and block table (scheduler ids)."""

    layer_names: list[str]
    spec: object
    builder: object
    block_table: torch.Tensor  # [max_reqs, blocks per request] int32, persistent
    slot_mapping: torch.Tensor  # [max_tokens] int64, persistent (attention groups)
    is_attention: bool


@dataclass
class StepInputs:
    """The scheduler's decisions for one step (host values)."""

    context: list[int]  # tokens already in the cache per request (before this step)
    tokens: list[int]  # T per request this step
    num_accepted: list[int] = field(default_factory=list)  # vLLM's num_accepted_tokens (1 after prefill)


class Stack:
    """vLLM's layers for one engine step, with their KV cache, builders and graphs.

    ``attn`` / ``gdn``: how many attention and GDN layers (real layer indices: every 4th is
    attention).  Layers are built when the stack is, so the plugin state at that moment decides
    the GDN class (vLLM's or the plugin's OOT `LazyQwenGDN`); the attention route is bound at
    call / capture time (`routing`).  ``max_reqs`` requests of up to ``max_context`` tokens.
    """

    def __init__(self, engine: Engine, name: str, *, attn: int, gdn: int, max_reqs: int, max_context: int,
                 seed: int = 0, gdn_eager_twin: bool = False) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        self.engine, self.name = engine, name
        self.plugin = _PLUGIN_ON[0]  # built after enable_plugin(): the plugin's layers
        cfg, shape = engine.config, engine.shape
        self.num_heads, self.num_kv_heads, self.head_dim = Q_HEADS, shape.kv_heads, shape.head_dim
        indices = [i for i in range(TOTAL_LAYERS) if is_attention_layer(i)][:attn] + \
                  [i for i in range(TOTAL_LAYERS) if not is_attention_layer(i)][:gdn]
        self.attn_layers: list = []
        self.gdn_layers: list = []
        gen = torch.Generator(device=engine.device).manual_seed(seed)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(engine.dtype)  # vLLM builds layers under the model dtype
        try:
            with set_current_vllm_config(cfg), torch.device(engine.device):
                for i in sorted(indices):
                    if is_attention_layer(i):
                        self.attn_layers.append(Attention(
                            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                            cache_config=cfg.cache_config, prefix=f"{name}.layers.{i}.self_attn.attn",
                            attn_backend=TritonAttentionBackend,
                        ))  # fmt: skip
                    else:
                        # HYPERHARNESS_GDN_LAZY_EAGER: the plugin layer's eager twin (tests only).
                        os.environ["HYPERHARNESS_GDN_LAZY_EAGER"] = "1" if gdn_eager_twin else "0"
                        layer = QwenGatedDeltaNetAttention(engine.hf_config, cfg, prefix=f"{name}.layers.{i}.linear_attn")
                        _init_gdn_weights(layer, gen)
                        self.gdn_layers.append(layer)
        finally:
            torch.set_default_dtype(old_dtype)
            os.environ.pop("HYPERHARNESS_GDN_LAZY_EAGER", None)
        self.max_reqs, self.max_context = max_reqs, max_context
        engine.align_block_size()
        self._init_kv_cache()
        self.graphs: dict = {}

    # -- KV cache, as the engine core and the GPU worker do it ------------------------------------

    def _init_kv_cache(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
        from vllm.v1.worker.utils import (
            allocate_kv_cache,
            bind_kv_cache,
            customize_attention_spec,
            select_common_block_size,
        )

        eng, cfg = self.engine, self.engine.config
        layers = {layer.layer_name: layer for layer in self.attn_layers} | {l.prefix: l for l in self.gdn_layers}
        specs = {}
        for name, layer in layers.items():  # the GPU runner's get_kv_cache_spec
            spec = layer.get_kv_cache_spec(cfg)
            if isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            specs[name] = spec
        if cfg.cache_config.kv_cache_layout is None:
            backends = get_current_attn_backends(cfg)
            resolve_kv_cache_layout(cfg, [[x.name for x in get_supported_kv_cache_layouts(backends)]], specs.values())
        # Two passes as the engine would size a pool: the groups first, then exactly the blocks
        # this stack's requests use (num_gpu_blocks_override, vLLM's own knob).
        cache = cfg.cache_config
        budget = [1 << 50]  # the override decides the pool; no allocation in the first pass
        cache.num_gpu_blocks_override = 1 << 20
        groups = get_kv_cache_configs(cfg, [specs], budget)[0].kv_cache_groups
        attn_groups = sum(isinstance(g.kv_cache_spec, AttentionSpec) for g in groups)
        # vLLM refuses a pool that cannot hold one request at max_model_len.
        context = max(self.max_context + 1 + eng.num_spec, cfg.model_config.max_model_len)
        blocks = 1 + attn_groups * self.max_reqs * math.ceil(context / eng.block_size)
        blocks += (len(groups) - attn_groups) * self.max_reqs * (2 + eng.num_spec)
        cache.num_gpu_blocks_override = blocks
        kv_config = get_kv_cache_configs(cfg, [specs], budget)[0]
        cache.num_gpu_blocks_override = None
        self.kv_config = kv_config
        kernel_sizes = []
        self.groups: list[Group] = []
        for group in kv_config.kv_cache_groups:
            spec = group.kv_cache_spec
            is_attn = isinstance(spec, AttentionSpec)
            if is_attn:
                backend = layers[group.layer_names[0]].attn_backend
                kernel_sizes.append(select_common_block_size(spec.block_size, [backend], [spec]))
                builder_cls = backend.get_builder_cls()
            else:
                assert isinstance(spec, MambaSpec)
                kernel_sizes.append(spec.block_size)
                from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as builder_cls
            builder = builder_cls(spec, group.layer_names, cfg, eng.device)
            width = spec.max_num_blocks_per_req(cfg, cfg.model_config.max_model_len)  # the runner's row length
            self.groups.append(Group(
                list(group.layer_names), spec, builder,
                torch.zeros(self.max_reqs, width, dtype=torch.int32, device=eng.device),
                torch.full((self.max_reqs * (1 + eng.num_spec),), -1, dtype=torch.int64, device=eng.device),
                is_attn,
            ))  # fmt: skip
        kv_caches = allocate_kv_cache(kv_config, eng.device, cfg.cache_config.get_resolved_kv_cache_layout(),
                                      kernel_sizes)
        self.kv_caches = kv_caches
        runner_caches: list[torch.Tensor] = []
        bind_kv_cache(kv_caches, {n: layers[n] for n in kv_caches}, runner_caches,
                      kv_cache_groups=kv_config.kv_cache_groups)
        self.num_blocks = kv_config.num_blocks
        self._next_block = 1  # block 0 is vLLM's null block

    def allocate_blocks(self, n: int) -> list[int]:
        if self._next_block + n > self.num_blocks:
            raise RuntimeError(f"{self.name}: pool of {self.num_blocks} blocks cannot give {n} more")
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return out


    # -- requests and blocks (the scheduler's part) -------------------------------------------

    def assign_blocks(self, seed: int = 0) -> None:
        """Give every request its blocks in every group, in a seeded random order (as a used pool
        hands them out).  Attention: enough for ``max_context + 1 + k`` tokens; GDN (align mode):
        the 1 + k window columns at the request's current scheduler block, set by `set_batch`."""
        eng = self.engine
        gen = torch.Generator().manual_seed(seed)
        self.attn_blocks: list[list[list[int]]] = []  # [group][request] -> block ids
        self.window_blocks: list[list[list[int]]] = []
        per_req = math.ceil((self.max_context + 1 + eng.num_spec) / eng.block_size)
        need = sum(per_req * self.max_reqs if g.is_attention else (1 + eng.num_spec) * self.max_reqs for g in self.groups)
        ids = torch.tensor(self.allocate_blocks(need))[torch.randperm(need, generator=gen)].tolist()
        for g in self.groups:
            n = per_req if g.is_attention else 1 + eng.num_spec
            rows = [ids[r * n : (r + 1) * n] for r in range(self.max_reqs)]
            ids = ids[n * self.max_reqs :]
            (self.attn_blocks if g.is_attention else self.window_blocks).append(rows)
            g.block_table.zero_()
            if g.is_attention:
                g.block_table[:, :per_req] = torch.tensor(rows, dtype=torch.int32)

    def fill_random(self, seed: int = 0) -> None:
        """Random contents in every block the requests use (timing never runs on zeros): int8
        K/V with fp32 scales in [0.005, 0.02] for attention, N(0, 1) conv and N(0, 0.1) recurrent
        states in the GDN windows.  Only those blocks: the groups share the pool's memory."""
        gen = torch.Generator(device=self.engine.device).manual_seed(seed)
        dev = self.engine.device
        for layer in self.attn_layers:
            layer.impl._pth_key_value_caches(layer.kv_cache)  # sets up the scale views
            gi = [g.layer_names for g in self.groups if g.is_attention].index(
                next(g.layer_names for g in self.groups if layer.layer_name in g.layer_names))
            for row in self.attn_blocks[gi]:
                idx = torch.tensor(row, device=dev)
                raw = layer.kv_cache[idx]
                layer.kv_cache[idx] = torch.randint(-127, 128, raw.shape, generator=gen, device=dev, dtype=torch.int8)
                for scales in (layer.impl._k_scale_cache, layer.impl._v_scale_cache):
                    scales[idx] = torch.empty(scales[idx].shape, device=dev).uniform_(0.005, 0.02, generator=gen)
        mamba = [g for g in self.groups if not g.is_attention]
        for layer in self.gdn_layers:
            gi = next(i for i, g in enumerate(mamba) if layer.prefix in g.layer_names)
            for row in self.window_blocks[gi]:
                idx = torch.tensor(row, device=dev)
                conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
                conv[idx] = torch.randn(conv[idx].shape, generator=gen, device=dev).to(conv.dtype)
                ssm[idx] = (torch.randn(ssm[idx].shape, generator=gen, device=dev) * 0.1).to(ssm.dtype)

    def window(self, group: int, req: int) -> list[int]:
        """Request `req`'s GDN window blocks (vLLM's spec_state_indices row) in mamba group `group`."""
        return self.window_blocks[group][req]

    def slots(self, req: int, positions: range, group: int = 0) -> list[int]:
        """Flat KV slot ids (block * block_size + offset) of token positions of request `req`."""
        bs = self.engine.block_size
        row = self.attn_blocks[group][req]
        return [row[p // bs] * bs + p % bs for p in positions]

    # -- one step's metadata, as the runner builds it ----------------------------------------

    def set_batch(self, step: StepInputs, *, for_capture: bool = False) -> tuple[dict, dict, object]:
        """Fill the persistent inputs for `step` and build every layer's metadata.

        Returns (attn_metadata per layer, slot_mapping per attention layer, BatchDescriptor).
        ``for_capture``: as `_dummy_run` before a FULL capture (max_seq_len = max_model_len,
        null blocks, no KV writes, `build_for_cudagraph_capture`)."""
        from vllm.forward_context import BatchDescriptor
        from vllm.v1.attention.backend import CommonAttentionMetadata

        eng = self.engine
        B = len(step.tokens)
        tokens = torch.tensor(step.tokens, dtype=torch.int32)
        seq = torch.tensor([c + t for c, t in zip(step.context, step.tokens, strict=True)], dtype=torch.int32)
        qsl_cpu = torch.zeros(B + 1, dtype=torch.int32)
        qsl_cpu[1:] = tokens.cumsum(0)
        N = int(qsl_cpu[-1])
        if not hasattr(self, "_qsl"):
            self._qsl = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=eng.device)
            self._seq = torch.zeros(self.max_reqs, dtype=torch.int32, device=eng.device)
            self._acc = torch.ones(self.max_reqs, dtype=torch.int32, device=eng.device)
        self._qsl[: B + 1].copy_(qsl_cpu)
        self._seq[:B].copy_(seq)
        acc = step.num_accepted or [1] * B
        self._acc[:B].copy_(torch.tensor(acc, dtype=torch.int32))
        md: dict = {}
        slot_mapping: dict = {}
        gi_attn = gi_mamba = 0
        for g in self.groups:
            if g.is_attention:
                pos = [self.slots(r, range(step.context[r], step.context[r] + step.tokens[r]), gi_attn) for r in range(B)]
                flat = [s for row in pos for s in row]
                g.slot_mapping[:N].copy_(torch.tensor([-1] * N if for_capture else flat, dtype=torch.int64))
                gi_attn += 1
            else:
                g.block_table.zero_()
                if not for_capture:
                    for r in range(B):
                        start = (int(seq[r]) - 1) // g.spec.block_size
                        g.block_table[r, start : start + 1 + eng.num_spec] = torch.tensor(
                            self.window(gi_mamba, r), dtype=torch.int32)
                gi_mamba += 1
            common = CommonAttentionMetadata(
                query_start_loc=self._qsl[: B + 1], query_start_loc_cpu=qsl_cpu, seq_lens=self._seq[:B],
                num_reqs=B, num_actual_tokens=N, max_query_len=int(tokens.max()),
                max_seq_len=eng.config.model_config.max_model_len if for_capture else int(seq.max()),
                block_table_tensor=g.block_table[:B], slot_mapping=g.slot_mapping[:N],
                seq_lens_cpu_upper_bound=seq, is_prefilling=torch.zeros(B, dtype=torch.bool),
            )  # fmt: skip
            if g.is_attention:
                built = (g.builder.build_for_cudagraph_capture(common) if for_capture
                         else g.builder.build(0, common))
                for name in g.layer_names:
                    slot_mapping[name] = g.slot_mapping[:N]
            else:
                drafts = torch.tensor([t - 1 for t in step.tokens], dtype=torch.int32)
                built = g.builder.build(0, common, num_accepted_tokens=self._acc[:B],
                                        num_decode_draft_tokens_cpu=drafts)
            for name in g.layer_names:
                md[name] = built
        uniform = len(set(step.tokens)) == 1
        return md, slot_mapping, BatchDescriptor(num_tokens=N, num_reqs=B, uniform=uniform)

    # -- running and capturing ---------------------------------------------------------------

    def run(self, module, inputs: tuple, step: StepInputs, *, graph: bool):
        """One step of `module(*inputs)`: eager, or the FULL CUDA graph for this batch shape
        (captured on first use after one eager warm-up on null blocks, as the runner does)."""
        with attention_route(self.plugin):
            return self._run(module, inputs, step, graph)

    def _run(self, module, inputs: tuple, step: StepInputs, graph: bool):
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        cfg = self.engine.config
        if not graph:
            md, sm, bd = self.set_batch(step)
            with set_forward_context(md, cfg, num_tokens=bd.num_tokens, slot_mapping=sm):
                return module(*inputs)
        key = (id(module), tuple(step.tokens))
        if key not in self.graphs:
            md, sm, bd = self.set_batch(step, for_capture=True)
            with set_forward_context(md, cfg, num_tokens=bd.num_tokens, batch_descriptor=bd, slot_mapping=sm):
                module(*inputs)  # warm-up: compiles kernels, allocates lazy state, writes null blocks only
            torch.cuda.synchronize()
            wrapper = CUDAGraphWrapper(module, cfg, CUDAGraphMode.FULL)
            set_cudagraph_capturing_enabled(True)
            try:
                md, sm, bd = self.set_batch(step, for_capture=True)
                with set_forward_context(md, cfg, num_tokens=bd.num_tokens, batch_descriptor=bd, slot_mapping=sm,
                                         cudagraph_runtime_mode=CUDAGraphMode.FULL):
                    wrapper(*inputs)
            finally:
                set_cudagraph_capturing_enabled(False)
            self.graphs[key] = wrapper
        md, sm, bd = self.set_batch(step)
        with set_forward_context(md, cfg, num_tokens=bd.num_tokens, batch_descriptor=bd, slot_mapping=sm,
                                 cudagraph_runtime_mode=CUDAGraphMode.FULL):
            return self.graphs[key](*inputs)


class AttentionStep(torch.nn.Module):
    """Every attention layer of a stack on the same q, k, v ([N, H*D] each): KV write + attention."""

    def __init__(self, stack: Stack) -> None:
        super().__init__()
        self.layers = stack.attn_layers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return [layer(q, k, v) for layer in self.layers]


class GdnCoreStep(torch.nn.Module):
    """Every GDN layer's recurrent core (vLLM's `qwen_gdn_attention_core` op: conv + delta rule,
    where the plugin's lazy commit lives) on the same projected inputs.
    mixed_qkv: [N, 2*H*K + HV*V]; b, a: [N, HV]; outs: per layer [N, HV, V] (written)."""

    def __init__(self, stack: Stack, outs: list[torch.Tensor]) -> None:
        super().__init__()
        self.layers = stack.gdn_layers
        self.outs = outs

    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> list[torch.Tensor]:
        from vllm.utils.torch_utils import _encode_layer_name

        for layer, out in zip(self.layers, self.outs, strict=True):
            out.zero_()  # as forward_cuda's torch.zeros
            torch.ops.vllm.qwen_gdn_attention_core(mixed_qkv, b, a, out, layer_name=_encode_layer_name(layer.prefix))
        return self.outs


class LayerStep(torch.nn.Module):
    """The whole step as the model calls the layers: attention layers on q, k, v, GDN layers
    (projections, core, gated norm, output projection) on hidden [N, 5120]."""

    def __init__(self, stack: Stack) -> None:
        super().__init__()
        self.attn = stack.attn_layers
        self.gdn = stack.gdn_layers

    def forward(self, q, k, v, hidden) -> list[torch.Tensor]:
        return [layer(q, k, v) for layer in self.attn] + [layer(hidden) for layer in self.gdn]


def _init_gdn_weights(layer, gen: torch.Generator) -> None:
    """Seeded weights of a plausible scale (a trained model's are not needed for the kernels'
    arithmetic): projections ~ N(0, 1/fan_in), conv ~ N(0, 0.5), A_log, dt_bias as Qwen3-Next
    initialises them (A in [1, 16], dt in [1e-3, 0.1] through softplus^-1), norm weight 1."""
    dev = gen.device
    with torch.no_grad():
        for p in (layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, layer.out_proj.weight):
            p.copy_(torch.randn(p.shape, generator=gen, device=dev) * p.shape[1] ** -0.5)
        w = layer.conv1d.weight
        w.copy_(torch.randn(w.shape, generator=gen, device=dev) * 0.5)
        hv = layer.A_log.shape[0]
        layer.A_log.copy_(torch.log(torch.empty(hv, device=dev).uniform_(1, 16, generator=gen)))
        dt = torch.exp(torch.empty(hv, device=dev).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
        layer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        layer.norm.weight.fill_(1.0)


def describe(engine: Engine) -> dict[str, object]:
    cfg = engine.config
    return {
        "platform": type(__import__("vllm.platforms", fromlist=["current_platform"]).current_platform).__name__,
        "block_size": engine.block_size,
        "num_spec": engine.num_spec,
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "capture_sizes": list(cfg.compilation_config.cudagraph_capture_sizes or []),
        "kv_cache_dtype": cfg.cache_config.cache_dtype,
        "mamba_ssm_cache_dtype": cfg.cache_config.mamba_ssm_cache_dtype,
        "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
        "env": {k: v for k, v in os.environ.items() if k.startswith("HYPERHARNESS_")},
    }


if __name__ == "__main__":
    eng = Engine()
    st = Stack(eng, "probe", attn=1, gdn=1, max_reqs=2, max_context=8192)
    print(json.dumps(describe(eng), indent=1))
    print(st.kv_config)
