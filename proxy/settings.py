"""Proxy settings: one frozen object, built from argv + environment by `Settings.from_argv`.

The flags are the contract with `hyperharness serve` (backend/cli), so keep them stable:
`--host --port --upstream --model-dir --model-name [--api-key-file] [--redis-url]`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

API_KEY_ENV = "HYPERHARNESS_API_KEY"
# The engine's own key, when it has one (vLLM's --api-key / VLLM_API_KEY); sent upstream, never to clients.
ENGINE_KEY_ENV = "HYPERHARNESS_ENGINE_API_KEY"


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    upstream: str = "http://127.0.0.1:8001"
    model_dir: Path | None = None
    model_name: str = "default"
    api_key: str | None = None
    upstream_api_key: str | None = None
    redis_url: str | None = None
    # Embedded store bounds: a transcript of a 100K-token session is ~400 KB packed, so 256 sessions
    # stay well under 128 MB even in the worst case.
    max_sessions: int = Field(default=256, ge=1)
    session_ttl_s: float = Field(default=6 * 3600, gt=0)
    snapshots_per_session: int = Field(default=4, ge=1)
    store_file: Path | None = None
    # Next-turn warm-up: prefill prompt+output with max_tokens=1 right after a response ends.
    warmup: bool = False
    upstream_timeout_s: float = Field(default=3600, gt=0)
    # how long an idle pooled connection to the engine is reused: below the engine's own keep-alive
    # (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so the engine is never the one to close it
    upstream_keepalive_s: float = Field(default=3.0, gt=0)
    # how long the proxy keeps a client's idle connection open: above every common client's own
    # reuse limit (httpx 5 s, undici 4 s, aiohttp 15 s), so a client never sends on a connection the
    # proxy is closing (uvicorn's default, 5 s, races httpx's); nginx uses 75 s for the same reason
    keep_alive_s: int = Field(default=75, ge=1)
    log_level: str = "info"

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL, got {value!r}")
        return value.rstrip("/")

    def check_exposure(self) -> None:
        """Refuse to serve a non-loopback address without a key (the engine behind us has none)."""
        if self.api_key or _is_loopback(self.host):
            return
        raise ValueError(
            f"refusing to bind {self.host!r} without an API key; set {API_KEY_ENV} or --api-key-file, or bind 127.0.0.1"
        )

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        args = _parser().parse_args(argv)
        api_key = env.get(API_KEY_ENV) or None
        if args.api_key_file is not None:
            api_key = _read_key(Path(args.api_key_file))
        engine_key = env.get(ENGINE_KEY_ENV) or env.get("VLLM_API_KEY") or None
        if args.upstream_api_key_file is not None:
            engine_key = _read_key(Path(args.upstream_api_key_file))
        return cls(
            host=args.host,
            port=args.port,
            upstream=args.upstream,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            model_name=args.model_name,
            api_key=api_key,
            upstream_api_key=engine_key,
            redis_url=args.redis_url or env.get("HYPERHARNESS_REDIS_URL") or None,
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl,
            store_file=Path(args.store_file) if args.store_file else None,
            warmup=args.warmup,
            upstream_keepalive_s=args.upstream_keepalive,
            keep_alive_s=args.keep_alive,
            log_level=args.log_level,
        )


def _read_key(path: Path) -> str:
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m proxy", description="HyperHarness OpenAI-compatible proxy")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--upstream", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--model-dir", default=None, help="model directory (tokenizer, chat format)")
    p.add_argument("--model-name", default="default", help="model id served to clients")
    p.add_argument("--api-key-file", default=None, help=f"file holding the bearer key (else ${API_KEY_ENV})")
    p.add_argument(
        "--upstream-api-key-file",
        default=None,
        help=f"file holding the engine's key (else ${ENGINE_KEY_ENV} or $VLLM_API_KEY)",
    )
    fields = Settings.model_fields
    p.add_argument("--keep-alive", type=int, default=fields["keep_alive_s"].default,
                   help="seconds a client's idle connection stays open")
    p.add_argument(
        "--upstream-keepalive", type=float, default=fields["upstream_keepalive_s"].default,
        help="seconds an idle connection to the engine is reused; keep it below the engine's keep-alive (vLLM: 5)",
    )
    p.add_argument("--redis-url", default=None, help="transcript store in Redis (default: in-process)")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--session-ttl", type=float, default=6 * 3600, help="seconds")
    p.add_argument("--store-file", default=None, help="persist the in-process store to this file")
    p.add_argument("--warmup", action="store_true", help="prefill the next turn's prefix after each reply")
    p.add_argument("--log-level", default="info")
    return p
