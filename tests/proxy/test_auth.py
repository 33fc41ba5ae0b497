"""The front door (proxy/auth.py) on a real uvicorn server: several keys from key files, both key
headers, every route but /health closed, and request-target / Host tricks refused. The tricks go over
raw sockets: httpx (like every client library) normalizes `..`, `//` and escapes before sending."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from backend.keys import ENV_VAR, load_or_create_key
from backend.launcher import ENGINE_HOST, engine_argv
from backend.profiles import load_profile
from proxy.app import create_app
from proxy.auth import KeyRing
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit]
aio = pytest.mark.asyncio(loop_scope="session")

KEYS = ("sk-main", "sk-second-client", "sk-third-ünïcode-and-much-longer-than-the-others")
CHAT = {"model": "hh", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MESSAGES = {"model": "hh", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
# (method, path, body): every kind of route the app has, each of which must be closed without a key
ROUTES = [
    ("GET", "/metrics", None), ("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/messages", MESSAGES), ("POST", "/v1/messages/count_tokens", MESSAGES),
    ("POST", "/v1/completions", {"model": "hh", "prompt": [1, 2], "max_tokens": 2}), ("GET", "/v1/files", None),
    ("GET", "/version", None), ("GET", "/api/tags", None), ("GET", "/nowhere", None),
]


@dataclass
class Env:
    url: str
    port: int
    fake: FakeVLLM
    store: MemoryStore


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    """The proxy as `serve` runs it: a config file naming key files, read by `Settings.load`."""
    root = tmp_path_factory.mktemp("input-auth")
    (root / "main.key").write_text(KEYS[0] + "\n")
    (root / "more.keys").write_text(f"# clients\n{KEYS[1]}\n\n{KEYS[2]}\n")
    fake = FakeVLLM(max_model_len=400)
    store = MemoryStore()
    async with fake_vllm_server(fake) as upstream_url:
        Settings(upstream=upstream_url, model_name="hh", api_key_file=root / "main.key",
                 api_key_files=(root / "more.keys",)).dump(root / "proxy.json")
        settings = Settings.load(root / "proxy.json")
        assert settings.keys == KEYS and "sk-" not in (root / "proxy.json").read_text()
        async with serve_app(create_app(settings, fmt=ToyFormat(), store=store)) as url:
            yield Env(url, int(url.rsplit(":", 1)[1]), fake, store)


async def raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request written byte for byte; returns status, headers and body (read to EOF/Content-Length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.replace("\n", "\r\n").encode("latin-1") + b"\r\n" + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        headers: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length", "0"))
        data = await asyncio.wait_for(reader.readexactly(n), 5)
        return int(status_line.split()[1]), headers, data
    finally:
        writer.close()


@aio
async def test_every_route_but_health_needs_a_key(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.url) as client:
        assert (await client.get("/health")).status_code == 200
        for method, path, body in ROUTES:
            for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-mai"},
                            {"authorization": "Basic " + KEYS[0]}, {"authorization": "Bearer"}):
                r = await client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                if path.startswith("/v1/messages"):
                    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key"
    assert env.fake.requests == [] and await env.store.count() == 0


@aio
async def test_each_key_works_on_both_wires(env: Env) -> None:
    async with httpx.AsyncClient(base_url=env.url) as client:
        for key in KEYS:
            for headers in ({"authorization": f"Bearer {key}"}, {"x-api-key": key}):
                hdrs = {k: v.encode() for k, v in headers.items()}  # the unicode key as UTF-8 bytes
                assert (await client.get("/v1/models", headers=hdrs)).status_code == 200
                r = await client.post("/v1/chat/completions", json=CHAT, headers=hdrs)
                assert r.status_code == 200, r.text
                r = await client.post("/v1/messages", json=MESSAGES, headers=hdrs)
                assert r.status_code == 200 and r.json()["type"] == "message", r.text


TRICKS = [
    "GET //v1/models HTTP/1.1",
    "GET //metrics HTTP/1.1",
    "GET /v1/../metrics HTTP/1.1",
    "GET /health/../metrics HTTP/1.1",
    "GET /health/%2e%2e/metrics HTTP/1.1",
    "GET /v1/%2e%2e/metrics HTTP/1.1",
    "GET /v1/%2E%2E/metrics HTTP/1.1",
    "GET /v1%2Fmodels HTTP/1.1",
    "GET /health%2F..%2Fmetrics HTTP/1.1",
    "GET /v1/./models HTTP/1.1",
    "GET /v1/models/.. HTTP/1.1",
    "GET /v1\\..\\metrics HTTP/1.1",
    "GET /health%00 HTTP/1.1",
    "GET http://evil/health/../metrics HTTP/1.1",
    "GET http://127.0.0.1/v1/%2e%2e/metrics HTTP/1.1",
]


@aio
@pytest.mark.parametrize("with_key", [False, True], ids=["no-key", "key"])
async def test_path_tricks_refused(env: Env, with_key: bool) -> None:
    """Refused before the key is looked at: with a valid key as well as without."""
    auth = f"\nAuthorization: Bearer {KEYS[0]}" if with_key else ""
    for line in TRICKS:
        status, _, body = await raw(env.port, f"{line}\nHost: 127.0.0.1{auth}\n")
        assert status == 400, (line, status, body)
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert b"vllm:" not in body and b"hyperharness_" not in body


@aio
async def test_host_tricks_refused(env: Env) -> None:
    for host in ("evil/?", "evil/v1/models?", "evil#", "user@evil", "evil?x=1", "evil\\x", " ", "[::1"):
        for path in ("/health", "/metrics", "/v1/models"):
            status, _, body = await raw(env.port, f"GET {path} HTTP/1.1\nHost: {host}\n")
            assert status == 400, (host, path, status, body)
    status, _, _ = await raw(env.port, "GET /health HTTP/1.1\nHost: a\nHost: b\n")
    assert status == 400
    for host in ("127.0.0.1", f"127.0.0.1:{env.port}", "localhost:1", "[::1]:8000", "proxy.example-1.org",
                 "hyper_harness:8000"):
        status, _, _ = await raw(env.port, f"GET /health HTTP/1.1\nHost: {host}\n")
        assert status == 200, host


@aio
async def test_absolute_form_is_its_path(env: Env) -> None:
    """uvicorn's parser reduces an absolute-form target to its path (RFC 9112 asks servers to accept
    it); the path then gets the same key check, whatever host the target names."""
    status, _, _ = await raw(env.port, "GET http://evil/metrics HTTP/1.1\nHost: 127.0.0.1\n")
    assert status == 401
    status, _, _ = await raw(env.port, f"GET http://evil/metrics HTTP/1.1\nHost: evil\nx-api-key: {KEYS[1]}\n")
    assert status == 200


def test_keyring_checks_every_key() -> None:
    ring = KeyRing(KEYS)
    assert all(ring.accepts(k.encode()) for k in KEYS)
    wrong = (b"", b"sk-main ", KEYS[2].encode()[:-1], KEYS[0].encode() + b"x", KEYS[2].encode("latin-1", "replace"))
    assert not ring.accepts() and not any(ring.accepts(k) for k in wrong) and not ring.accepts(*wrong)
    assert ring.accepts(b"junk", KEYS[1].encode())  # Authorization and x-api-key both sent: either may hold it
    assert not KeyRing(()) and not KeyRing(()).accepts(b"anything")


def test_serve_key_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve`'s single key: $HYPERHARNESS_API_KEY wins (serve writes it into .run/keys/api_key, which the
    proxy config names), else the key file is created once with mode 0600 and re-read."""
    path = tmp_path / "cfg" / "api_key"
    monkeypatch.delenv(ENV_VAR, raising=False)
    key, source = load_or_create_key(path)
    assert key and source.endswith("(created)") and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(path) == (key, str(path))
    monkeypatch.setenv(ENV_VAR, " sk-from-env\n")
    assert load_or_create_key(path) == ("sk-from-env", f"${ENV_VAR}")


def test_engine_binds_loopback_only() -> None:
    """The engine behind the proxy listens on 127.0.0.1 only (its key comes as VLLM_API_KEY, set by
    `serve`: in the environment, not in argv where `ps` shows it)."""
    for name in ("cpu-smol", "cpu-hybrid"):
        argv = engine_argv(load_profile(name), "/m", 8123)
        assert argv[argv.index("--host") + 1] == ENGINE_HOST == "127.0.0.1"
        assert "--api-key" not in argv


def test_no_exposure_without_a_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without an API key"):
        Settings(upstream="http://127.0.0.1:1", host="0.0.0.0").check_exposure()
    Settings(upstream="http://127.0.0.1:1", host="0.0.0.0", api_keys=("k",)).check_exposure()
    (tmp_path / "empty").write_text("# nobody\n\n")
    Settings(upstream="http://127.0.0.1:1", api_key_files=(tmp_path / "empty",)).dump(tmp_path / "p.json")
    with pytest.raises(ValueError, match="holds no key"):
        Settings.load(tmp_path / "p.json")
