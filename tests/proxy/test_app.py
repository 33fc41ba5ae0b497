"""The HTTP surface against a fake vLLM: auth, errors, health, models, pass-through streaming."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio

from proxy.app import create_app
from proxy.settings import Settings
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-test-key"


@pytest_asyncio.fixture(loop_scope="session")
async def proxy_url():  # type: ignore[no-untyped-def]
    fake = FakeVLLM()
    async with fake_vllm_server(fake) as upstream_url:
        settings = Settings(upstream=upstream_url, model_name="hh", api_key=KEY)
        async with serve_app(create_app(settings)) as url:
            yield url, fake


async def test_health_is_open(proxy_url) -> None:  # type: ignore[no-untyped-def]
    url, _ = proxy_url
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"authorization": "Basic " + KEY}]
)
async def test_auth_rejects(proxy_url, headers) -> None:  # type: ignore[no-untyped-def]
    url, _ = proxy_url
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/v1/models", headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{"authorization": "Bearer " + KEY}, {"x-api-key": KEY}])
async def test_models_lists_context(proxy_url, headers) -> None:  # type: ignore[no-untyped-def]
    url, _ = proxy_url
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/v1/models", headers=headers)
    assert r.status_code == 200
    (entry,) = r.json()["data"]
    assert entry["id"] == "hh"
    assert entry["max_model_len"] == entry["context_length"] == 4096


async def test_passthrough_streams_and_rewrites_model(proxy_url) -> None:  # type: ignore[no-untyped-def]
    url, fake = proxy_url
    body = {"model": "anything", "prompt": [1, 2, 3], "stream": True}
    async with httpx.AsyncClient() as c:
        async with c.stream("POST", url + "/v1/completions", json=body, headers={"x-api-key": KEY}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            text = "".join([part async for part in r.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    assert fake.requests[-1]["model"] == "fake-model"


async def test_malformed_json_is_400(proxy_url) -> None:  # type: ignore[no-untyped-def]
    url, _ = proxy_url
    async with httpx.AsyncClient() as c:
        r = await c.post(url + "/v1/completions", content=b"{nope", headers={"x-api-key": KEY})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_unknown_route_is_openai_404(proxy_url) -> None:  # type: ignore[no-untyped-def]
    url, _ = proxy_url
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/nope", headers={"x-api-key": KEY})
    assert r.status_code == 404
    assert "error" in r.json()


async def test_health_503_when_engine_down() -> None:
    settings = Settings(upstream="http://127.0.0.1:9", model_name="hh")
    async with serve_app(create_app(settings)) as url:
        async with httpx.AsyncClient() as c:
            r = await c.get(url + "/health")
    assert r.status_code == 503
