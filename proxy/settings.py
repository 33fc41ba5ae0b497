"""The proxy's runtime config: one frozen object, written by `hyperharness serve` as one JSON file and read
by `python -m proxy --config FILE`. Nothing reaches the proxy through the environment.

    Settings                 bind address, model, keys, store, timeouts
    ├── upstreams            the engines behind it (one today), each with
    │   └── EngineGeometry   what backend/geometry.py computed for it: seats, speculative tokens, KV groups,
    │                        recurrent-state pages per seat (the scheduler counts these; the engine's
    │                        /metrics only tells the pool's size)
    └── scheduler            admission policy knobs (SchedulerConfig)

Secrets never sit in the file: it names key files (mode 0600), which `Settings.load` reads.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SchedulerConfig(_Frozen):
    """Admission policy (proxy/scheduler). Engine facts (seats, speculative tokens) are `EngineGeometry`'s."""

    reserve_fraction: float = Field(default=0.1, ge=0, lt=1)  # share of the pool only interactive requests use
    reserve_seats: int = Field(default=1, ge=0)  # seats only interactive requests use (when seats > 1)
    max_queue: int = Field(default=256, ge=0)  # waiting requests beyond this get 429
    max_wait_s: tuple[float, float, float] = (600.0, 1200.0, 1800.0)  # per class -> 503
    backfill_bound_s: float = Field(default=2.0, ge=0)  # longest the head may be passed over by backfill
    backfill_fraction: float = Field(default=0.05, ge=0, le=1)  # "short": worst case within this pool share
    refresh_s: float = Field(default=1.0, gt=0)  # engine /metrics poll period
    keepalive_after_s: float = Field(default=2.0, ge=0)  # a queued stream is answered 200 + SSE comments
    keepalive_every_s: float = Field(default=10.0, gt=0)
    enabled: bool = True


class EngineGeometry(_Frozen):
    """One engine's pool geometry as admission needs it, computed by `serve` from the profile (all None /
    0 when unknown: then only what the engine's /metrics tells is counted).

    Pool blocks are engine block ids: on a hybrid model every KV-cache group draws from one pool, a token
    block costs one id per attention group and a seat's recurrent state one id per GDN group and slot."""

    seats: int | None = Field(default=None, ge=1)  # max_num_seqs
    max_model_len: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)  # tokens per attention block after hybrid unification
    pool_blocks: int | None = Field(default=None, ge=1)  # expected; the engine's own count wins once read
    attn_groups: int = Field(default=1, ge=1)
    gdn_groups: int = Field(default=0, ge=0)
    state_slots_per_seat: int = Field(default=0, ge=0)  # per GDN group: 2+k in align mode, 1+k otherwise
    drafter_blocks_per_seat: int = Field(default=0, ge=0)  # the drafter's own KV, in pool block ids
    spec_tokens: int = Field(default=0, ge=0)  # speculative tokens per step (lookahead slots)

    @property
    def state_blocks_per_seat(self) -> int:
        return self.state_slots_per_seat * self.gdn_groups + self.drafter_blocks_per_seat


class UpstreamConfig(_Frozen):
    name: str = "engine-0"
    url: str
    api_key_file: Path | None = None  # the engine's own key (vLLM --api-key); sent upstream, never to clients
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    geometry: EngineGeometry = EngineGeometry()

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL, got {value!r}")
        return value.rstrip("/")


class Settings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    upstreams: tuple[UpstreamConfig, ...] = Field(min_length=1)
    model_dir: Path | None = None
    model_name: str = "default"
    api_key_file: Path | None = None
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    redis_url: str | None = None
    # Embedded store bounds: a transcript of a 100K-token session is ~400 KB packed, so 256 sessions
    # stay well under 128 MB even in the worst case.
    max_sessions: int = Field(default=256, ge=1)
    session_ttl_s: float = Field(default=6 * 3600, gt=0)
    snapshots_per_session: int = Field(default=4, ge=1)
    store_file: Path | None = None
    # Next-turn warm-up: prefill prompt+output with max_tokens=1 right after a response ends.
    warmup: bool = False
    default_thinking: bool = True  # a request that does not say gets the template's thinking mode
    upstream_timeout_s: float = Field(default=3600, gt=0)
    # how long an idle pooled connection to the engine is reused: below the engine's own keep-alive
    # (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so the engine is never the one to close it
    upstream_keepalive_s: float = Field(default=3.0, gt=0)
    # how long the proxy keeps a client's idle connection open: above every common client's own
    # reuse limit (httpx 5 s, undici 4 s, aiohttp 15 s), so a client never sends on a connection the
    # proxy is closing (uvicorn's default, 5 s, races httpx's); nginx uses 75 s for the same reason
    keep_alive_s: int = Field(default=75, ge=1)
    log_level: str = "info"
    scheduler: SchedulerConfig = SchedulerConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_upstream_url(cls, data: Any) -> Any:
        """`upstream=URL` (in code and tests) is short for one upstream with no geometry facts."""
        if isinstance(data, dict) and "upstream" in data:
            data = dict(data)
            url = data.pop("upstream")
            data["upstreams"] = (url if isinstance(url, UpstreamConfig) else UpstreamConfig(url=url),)
        return data

    @property
    def upstream(self) -> UpstreamConfig:
        """The engine (serving over several engines is the scale-out work; one is configured today)."""
        return self.upstreams[0]

    def check_exposure(self) -> None:
        """Refuse to serve a non-loopback address without a key (the engine behind us has none)."""
        if self.api_key or _is_loopback(self.host):
            return
        raise ValueError(
            f"refusing to bind {self.host!r} without an API key; give api_key_file or bind 127.0.0.1"
        )

    @classmethod
    def load(cls, path: Path) -> Settings:
        """The config file `serve` wrote, with the key files it names read."""
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the proxy config {path}: {exc}") from exc
        settings = cls.model_validate(raw)
        upstreams = tuple(
            u.model_copy(update={"api_key": read_key(u.api_key_file)}) if u.api_key_file else u
            for u in settings.upstreams
        )
        key = read_key(settings.api_key_file) if settings.api_key_file else None
        return settings.model_copy(update={"upstreams": upstreams, "api_key": key})

    def dump(self, path: Path) -> None:
        """Write the config (no secrets: key files by path) readable by its owner only."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.model_dump_json(indent=2) + "\n")


def read_key(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from exc
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
