"""Typed launch profiles (configs/<name>.yaml).

A profile names every engine flag explicitly: what runs is what the file says, so `--dry-run` output,
the boot-time pool check and the real process all derive from one validated object. Unknown keys are
errors, because a misspelt flag silently falling back to vLLM's default is the failure mode we most
want to rule out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

KVCacheDtype = Literal["auto", "bfloat16", "fp8", "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head"]
StateDtype = Literal["auto", "float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftVocab(_Strict):
    """The MTP drafter's vocabulary (`hyperharness models draft-vocab`): the `size` ids the model itself
    emits most on the shipped prompt set, plus every special token; its rows of lm_head become
    `mtp.draft_lm_head` in the prepared model (patch 0008)."""

    size: int = Field(ge=256)
    prompt_set: str = "agent"  # backend/models/prompts/<prompt_set>.jsonl
    max_tokens: int = Field(default=256, ge=16)  # generated per prompt


class Prepare(_Strict):
    """`hyperharness models prepare --profile P`: int8 group-128 parts written into a prepared copy of
    the checkpoint, which the engine serves instead of the download (backend/models/prepare.py)."""

    parts: tuple[Literal["lm_head", "embed_tokens", "mtp"], ...] = ("lm_head", "embed_tokens", "mtp")
    keep_mtp_fc: bool = False
    draft_vocab: DraftVocab | None = None


class ModelSource(_Strict):
    """Where the weights come from: an embedded (generated-on-first-use) model or a Hugging Face repo."""

    embedded: str | None = None  # name in backend.models.REGISTRY
    hf_repo: str | None = None  # downloaded with huggingface_hub into the cache
    hf_revision: str | None = None
    path: Path | None = None  # an explicit local directory wins over both
    served_name: str
    shape: str | None = None  # configs/shapes/<shape>.yaml: the geometry before the weights are local
    prepare: Prepare | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if sum(x is not None for x in (self.embedded, self.hf_repo, self.path)) != 1:
            raise ValueError("model: give exactly one of embedded, hf_repo, path")
        if self.prepare is not None and self.embedded is not None:
            raise ValueError("model.prepare applies to a downloaded checkpoint (hf_repo or path), "
                             "not an embedded model")
        return self


class LookupFusion(_Strict):
    """LABD: lookup drafts (kernels.lookup_scan over each request's history) fused into the DFlash
    drafter's proposal; our plugin + patch 0004, not a vLLM option (backend/plugin/labd.py)."""

    min_n: int = Field(default=4, ge=1, le=31)  # NSTRONG: shortest match that overrides the drafter
    max_n: int = Field(default=16, ge=1, le=31)
    agree: int = Field(default=0, ge=0)  # AGREE: the drafter's first tokens must match too

    def to_env(self) -> dict[str, str]:
        return {
            "HYPERHARNESS_LABD": "1",
            "HYPERHARNESS_LABD_MIN_N": str(self.min_n),
            "HYPERHARNESS_LABD_MAX_N": str(self.max_n),
            "HYPERHARNESS_LABD_AGREE": str(self.agree),
        }


class Speculative(_Strict):
    method: Literal["dflash", "mtp", "ngram"]
    model: str | None = None  # drafter repo / path (dflash)
    num_speculative_tokens: int = Field(ge=1, le=32)
    draft_sample_method: Literal["greedy", "probabilistic"] | None = None
    disable_eagle_block_drop: bool | None = None
    labd: LookupFusion | None = None  # ours (plugin env), never passed to vLLM

    @model_validator(mode="after")
    def _labd_fits(self) -> Speculative:
        if self.labd is not None:
            if self.method != "dflash":
                raise ValueError("speculative.labd fuses lookup into the DFlash drafter: method must be dflash")
            if self.labd.min_n > self.labd.max_n:
                raise ValueError("speculative.labd: min_n must be <= max_n")
            if self.labd.agree > self.num_speculative_tokens:
                raise ValueError("speculative.labd: agree must be <= num_speculative_tokens")
        return self

    def to_json(self) -> dict:
        return self.model_dump(exclude_none=True, exclude={"labd"})

    def plugin_env(self) -> dict[str, str]:
        return self.labd.to_env() if self.labd is not None else {"HYPERHARNESS_LABD": "0"}


class PluginSwitches(_Strict):
    """Which of our kernels the engine's plugin routes to (backend/plugin, read by every vLLM process
    from HYPERHARNESS_* variables). Each is on only where the H200 measurements say it pays, in vLLM's
    own layers (tests/gpu/NOTES.md): verify attention 140x vLLM's at 100K T=8; the lazy GDN commit
    slower than vLLM's own GDN core today (121 vs 35 us per layer), so off."""

    verify_attention: bool = False  # T>1 batches on the int8 per-token-head cache -> kernels.verify_attention
    gdn_lazy: bool = False  # lazy GDN state commit -> kernels.gdn_verify (needs patch 0003 in align mode)

    def to_env(self) -> dict[str, str]:
        return {"HYPERHARNESS_VERIFY_ATTN": str(int(self.verify_attention)),
                "HYPERHARNESS_GDN_LAZY": str(int(self.gdn_lazy))}


class Drafter(_Strict):
    """Shapes of the drafter's own attention cache (for the pool geometry)."""

    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    sliding_window: int | None = Field(default=None, ge=1)


class KVEvents(_Strict):
    """vLLM's KV-cache events (`--kv-events-config`): every block the engine stores or evicts, published
    over ZMQ, so an index-based router (llm-d's KV-cache manager, NVIDIA Dynamo's KV router) can run in
    front of or beside our proxy (docs/scale-out.md). Engine i of `serve --engines N` publishes on the
    endpoint's port + i, so engines side by side never share a socket."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # where a subscriber that joined late asks for recent events
    topic: str = "kv-events"
    buffer_steps: int = Field(default=10_000, ge=1)

    def to_json(self, index: int = 0) -> dict:
        out: dict = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": self.topic,
                     "buffer_steps": self.buffer_steps, "endpoint": _port_plus(self.endpoint, index)}
        if self.replay_endpoint:
            out["replay_endpoint"] = _port_plus(self.replay_endpoint, index)
        return out


def _port_plus(endpoint: str, index: int) -> str:
    """`tcp://*:5557` -> `tcp://*:5558` for index 1; an endpoint with no port (ipc://) gets a suffix."""
    if index == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and head.startswith("tcp"):
        return f"{head}:{int(port) + index}"
    return f"{endpoint}-{index}"


class Engine(_Strict):
    device: Literal["cpu", "cuda"]
    max_model_len: int = Field(ge=256)
    max_num_seqs: int = Field(ge=1, le=1024)
    max_num_batched_tokens: int = Field(ge=16)
    # the weights' and activations' dtype (vLLM --dtype); "auto" = the checkpoint's
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    kv_cache_dtype: KVCacheDtype
    mamba_ssm_cache_dtype: StateDtype = "auto"
    attention_backend: str | None = None
    block_size: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)  # per card (vLLM applies it per worker)
    # several cards, one stage of layers each; a speculator runs on the last stage (patch 0007)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=8)
    cpu_kvcache_space_gib: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool
    mamba_cache_mode: Literal["align", "none"] | None = None
    prefix_match_unit: int | None = Field(default=None, ge=1)
    prefix_cache_retention_interval: int | None = Field(default=None, ge=0)
    enforce_eager: bool
    language_model_only: bool = False
    async_scheduling: bool | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    sse_keep_alive_interval: int | None = Field(default=None, ge=0)
    # usage.prompt_tokens_details.cached_tokens: the proxy reports cache hits from it
    enable_prompt_tokens_details: bool = True
    compilation_config: dict | None = None
    speculative: Speculative | None = None
    kv_events: KVEvents | None = None  # None: vLLM publishes none (its default)
    drafter: Drafter | None = None
    plugin: PluginSwitches = PluginSwitches()
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)

    def plugin_env(self) -> dict[str, str]:
        """The HYPERHARNESS_* switches this profile sets for our vLLM plugin (before `env`)."""
        labd = self.speculative.plugin_env() if self.speculative else {"HYPERHARNESS_LABD": "0"}
        return {**labd, **self.plugin.to_env()}

    @model_validator(mode="after")
    def _coherent(self) -> Engine:
        if self.kv_cache_dtype.endswith("_per_token_head") and self.attention_backend != "TRITON_ATTN":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is read only by attention_backend TRITON_ATTN")
        if self.device == "cpu" and self.speculative is not None:
            raise ValueError("speculative decoding profiles are GPU-only")
        if self.mamba_ssm_cache_dtype == "float16" and self.speculative is not None:
            # vLLM 0.32's fused GDN spec kernel takes fp32/bf16 only; fp16 silently falls back to Triton.
            raise ValueError("mamba_ssm_cache_dtype float16 with a speculator falls off the fused GDN path")
        if self.speculative and self.speculative.method == "dflash" and self.drafter is None:
            raise ValueError("a dflash speculator needs `drafter:` shapes for the pool geometry")
        if self.device == "cuda" and self.kv_cache_memory_bytes is None and self.gpu_memory_utilization is None:
            raise ValueError("a cuda profile sets kv_cache_memory_bytes or gpu_memory_utilization")
        if self.plugin.verify_attention and (self.device != "cuda" or self.kv_cache_dtype != "int8_per_token_head"):
            raise ValueError("plugin.verify_attention serves the int8_per_token_head cache on CUDA only")
        if self.pipeline_parallel_size > 1 and self.device != "cuda":
            raise ValueError("pipeline_parallel_size > 1 is for GPU profiles (one stage per card)")
        return self


class Memory(_Strict):
    """The budget the boot check holds the worst case against."""

    device_memory_gib: float | None = Field(default=None, gt=0)  # None: read from the device at boot
    reserve_gib: float = Field(default=0.0, ge=0)  # graphs, activations, allocator slack


class ProxyConf(_Strict):
    host: str | None = None  # None: 0.0.0.0 with a key, 127.0.0.1 without
    port: int = Field(default=8000, ge=1, le=65535)
    engine_port: int = Field(default=8100, ge=1, le=65535)


class Profile(_Strict):
    name: str
    description: str
    model: ModelSource
    engine: Engine
    memory: Memory = Memory()
    proxy: ProxyConf = ProxyConf()

    @model_validator(mode="after")
    def _draft_vocab_has_a_drafter(self) -> Profile:
        prep = self.model.prepare
        if prep is not None and prep.draft_vocab is not None:
            spec = self.engine.speculative
            if spec is None or spec.method != "mtp":
                raise ValueError("model.prepare.draft_vocab is the MTP drafter's vocabulary: "
                                 "speculative.method must be mtp")
            if "lm_head" not in prep.parts:
                raise ValueError("model.prepare.draft_vocab slices the int8 lm_head: "
                                 "keep lm_head in model.prepare.parts")
        return self


class ProfileError(ValueError):
    pass


def profile_path(name: str, config_dir: Path = CONFIG_DIR) -> Path:
    return config_dir / f"{name}.yaml"


def available_profiles(config_dir: Path = CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in config_dir.glob("*.yaml"))


def load_profile(name_or_path: str | Path, config_dir: Path = CONFIG_DIR) -> Profile:
    path = Path(name_or_path)
    if not path.suffix:
        path = profile_path(str(name_or_path), config_dir)
    if not path.is_file():
        raise ProfileError(
            f"no profile {str(name_or_path)!r}; available: {', '.join(available_profiles(config_dir))}"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: a profile is a mapping")
    raw.setdefault("name", path.stem)
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
