"""proxy/front.py: the turn paths answered before FastAPI's stack keep the front door's rules, the
router still owns their other methods, and a handler's crash is an OpenAI-shaped 500."""

from __future__ import annotations

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from proxy.app import create_app
from proxy.auth import Guard
from proxy.front import ProxyApp
from proxy.settings import Settings
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

KEY = "sk-front"
CHAT = {"model": "hh", "messages": [{"role": "user", "content": "hi"}]}


async def test_the_turn_paths_keep_the_front_doors_rules() -> None:
    fake = FakeVLLM()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", api_key=KEY)
        settings = settings.model_copy(update={"limits": settings.limits.model_copy(update={"max_body_bytes": 4096})})
        async with serve_app(create_app(settings)) as url, httpx.AsyncClient() as c:
            for path in ("/v1/chat/completions", "/v1/messages"):
                r = await c.post(url + path, json=CHAT)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                r = await c.post(url + path, json=CHAT, headers={"x-api-key": KEY, "host": "evil/?"})
                assert r.status_code == 400 and "Host header" in r.text
                r = await c.post(url + path, json={**CHAT, "pad": "x" * 5000}, headers={"x-api-key": KEY})
                assert r.status_code == 413
            # another method on a turn path is the router's 405, never relayed to the engine
            r = await c.get(url + "/v1/chat/completions", headers={"x-api-key": KEY})
            assert r.status_code == 405
            assert fake.requests == []
            # with the key, the turn reaches its handler (no chat format here: vLLM renders)
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY})
            assert r.status_code == 200 and len(fake.requests) == 1


async def test_a_handler_that_crashes_is_an_openai_500() -> None:
    async def crash(request: Request) -> Response:
        raise RuntimeError("a bug")

    app = ProxyApp()
    app.serve_turns({"/v1/chat/completions": crash}, lambda inner: Guard(inner))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                 "param": None, "code": None}
