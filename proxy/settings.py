"""The proxy's runtime config: one frozen object, written by `hyperharness serve` as one JSON file and read
by `python -m proxy --config FILE`. Nothing reaches the proxy through the environment.

    Settings                 bind address, model, keys, store, timeouts
    ├── upstreams            the engines behind it (one or more, unique names, weights), each with
    │   └── EngineGeometry   what backend/geometry.py computed for it: seats, speculative tokens, KV groups,
    │                        recurrent-state pages per seat (the scheduler counts these; the engine's
    │                        /metrics only tells the pool's size)
    ├── scheduler            admission policy knobs (SchedulerConfig), one scheduler per engine
    └── routing              placement over several engines (RoutingConfig)

Secrets never sit in the file: it names key files (mode 0600), which `Settings.load` reads.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SchedulerConfig(_Frozen):
    """Admission policy (proxy/scheduler). Engine facts (seats, speculative tokens) are `EngineGeometry`'s."""

    reserve_fraction: float = Field(default=0.1, ge=0, lt=1)  # pool share kept for interactive requests until
    reserve_seats: int = Field(default=1, ge=0)  # ... (and seats) their own demand is observed (scheduler/reserve.py)
    reserve_window_s: float = Field(default=300.0, gt=0)  # the interactive peak over this window sizes the reserve
    reserve_max_fraction: float = Field(default=0.5, ge=0, lt=1)  # the observed reserve never exceeds this share
    prefix_recent_s: float = Field(default=30.0, ge=0)  # a finished request's prompt blocks count as cached this long
    max_queue: int = Field(default=256, ge=0)  # waiting requests beyond this get 429
    max_wait_s: tuple[float, float, float] = (600.0, 1200.0, 1800.0)  # per class -> 503
    backfill_bound_s: float = Field(default=2.0, ge=0)  # longest the head may be passed over by backfill
    backfill_fraction: float = Field(default=0.05, ge=0, le=1)  # "short": worst case within this pool share
    # (or at most half what the blocked head needs)
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


class InputLimits(_Frozen):
    """Bounds on what a client may send, checked before any work is done for it (proxy/auth.py for the
    body size, proxy/http.py for the JSON). Real agent requests stay far below: a 200K-token history is
    ~1 MB of JSON, a few screenshots a few MB more; 32 MiB leaves room for images and refuses a flood."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)  # larger bodies: 413, counted as streamed
    max_json_depth: int = Field(default=64, ge=8)  # deepest JSON nesting (a tool schema's is ~10-15)
    # Off by default: one model is served and harnesses name it in their own ways (DeepSeek Harness
    # sends its "flash" model name for side requests). On: any other name is a 404 model_not_found.
    strict_model: bool = False


class UpstreamConfig(_Frozen):
    name: str = "engine-0"
    url: str
    api_key_file: Path | None = None  # the engine's own key (vLLM --api-key); sent upstream, never to clients
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    geometry: EngineGeometry = EngineGeometry()
    weight: float = Field(default=1.0, gt=0)  # share of new sessions relative to the others (bigger card: more)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL, got {value!r}")
        return value.rstrip("/")


class RoutingConfig(_Frozen):
    """Placement over several engines (proxy/routing). Unused with one engine."""

    health_period_s: float = Field(default=2.0, gt=0)  # each engine's /health is read this often
    health_timeout_s: float = Field(default=1.0, gt=0)
    failures_to_drain: int = Field(default=2, ge=1)  # consecutive failed checks before an engine is drained
    load_factor: float = Field(default=1.25, ge=1)  # bounded-load hashing: spill above this x the average
    # A session leaves a live engine only when that engine's admission queue has made a request wait
    # longer than this (seconds) and another engine has room: re-prefilling costs less than waiting.
    move_after_wait_s: float = Field(default=30.0, gt=0)
    prefix_block_tokens: int = Field(default=64, ge=1)  # granularity of the recorded sent-prefix hashes
    state_ttl_s: float = Field(default=6 * 3600, gt=0)  # placement records (refreshed on use)
    # ours; the others are the baselines `hyperharness bench route` compares it with
    policy: Literal["affinity", "round_robin", "session_hash", "least_loaded"] = "affinity"


class Settings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    upstreams: tuple[UpstreamConfig, ...] = Field(min_length=1)
    model_dir: Path | None = None
    model_name: str = "default"
    api_key_file: Path | None = None
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    # More client keys: files of one key a line (mode 0600), read by `load`; any key opens every route.
    api_key_files: tuple[Path, ...] = ()
    api_keys: tuple[str, ...] = Field(default=(), repr=False, exclude=True)
    limits: InputLimits = InputLimits()
    redis_url: str | None = None
    # While Redis is unreachable: "fallback" keeps transcripts in an embedded store and writes them back
    # when it returns (a transcript only saves a re-prefill, so agents keep working); "refuse" answers
    # 503 + Retry-After (for proxies sharing Redis, where one proxy's memory is invisible to the rest).
    redis_outage: Literal["fallback", "refuse"] = "fallback"
    redis_timeout_s: float = Field(default=1.0, gt=0)  # bounds each Redis call (a stopped Redis never answers)
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
    routing: RoutingConfig = RoutingConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_upstream_url(cls, data: Any) -> Any:
        """`upstream=URL` (in code and tests) is short for one upstream with no geometry facts."""
        if isinstance(data, dict) and "upstream" in data:
            data = dict(data)
            url = data.pop("upstream")
            data["upstreams"] = (url if isinstance(url, UpstreamConfig) else UpstreamConfig(url=url),)
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique, got {names}")
        return self

    @property
    def upstream(self) -> UpstreamConfig:
        """The first engine (what single-engine code paths use; placement picks among all of them)."""
        return self.upstreams[0]

    @property
    def keys(self) -> tuple[str, ...]:
        """Every client key this proxy accepts (none: no key is asked for)."""
        return ((self.api_key,) if self.api_key else ()) + self.api_keys

    def check_exposure(self) -> None:
        """Refuse to serve a non-loopback address without a key (the engine behind us has none)."""
        if self.keys or _is_loopback(self.host):
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
        more = tuple(k for f in settings.api_key_files for k in read_keys(f))
        return settings.model_copy(update={"upstreams": upstreams, "api_key": key, "api_keys": more})

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


def read_keys(path: Path) -> tuple[str, ...]:
    """A key file of one key a line (blank lines and `#` comments skipped), for several clients."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {path}: {exc}") from exc
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return keys


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
