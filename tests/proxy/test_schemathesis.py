"""schemathesis against the proxy's own OpenAPI document (proxy/openapi.py): chat/completions,
completions, messages and models, with valid (positive) and schema-violating (negative) bodies, on a
real uvicorn server with the real Qwen3.x chat format (tokenizer and template as prepared for the tiny
hybrid) in front of the fake vLLM. Every answer must be below 500, and every 4xx shaped as its wire's
error. Examples are bounded and derandomized (same cases on every CI run).

The document is taken from `openapi_document()` rather than fetched: it is the same function the
proxy serves at /openapi.json (checked below), and loading it here needs no server at collection.
For the fuzz its objects are closed (`additionalProperties: false`): the proxy ignores unknown fields
by design, and generating arbitrary extra JSON made each example ~4x slower while testing nothing the
typed fields do not."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.format import load_format  # noqa: E402
from proxy.openapi import openapi_document  # noqa: E402
from proxy.settings import Settings  # noqa: E402
from proxy.store.memory import MemoryStore  # noqa: E402
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app  # noqa: E402
from tests.proxy.test_format_loader import make_qwen_dir  # noqa: E402

pytestmark = [pytest.mark.unit]

KEY = "sk-fuzz"
AUTH = {"authorization": f"Bearer {KEY}"}
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 15}  # per operation
BOUND_S = 5.0  # any answer, including a rendered prompt that does not fit (here: 2 busy cores)
OPERATIONS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "GET /v1/models")
SEEN: Counter[tuple[str, int]] = Counter()


class Server:
    """The proxy and the fake engine on their own event loop in a thread (schemathesis calls are sync)."""

    def __init__(self, model_dir: Path) -> None:
        self.fake = FakeVLLM(max_model_len=2048)
        self.store = MemoryStore()
        self.fmt = load_format(model_dir)
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with fake_vllm_server(self.fake) as upstream_url:
            app = create_app(Settings(upstream=upstream_url, model_name="hh", api_key=KEY), fmt=self.fmt,
                             store=self.store)
            async with serve_app(app) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()

    def __enter__(self) -> Server:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the proxy did not start")
        return self

    def __exit__(self, *_: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(make_qwen_dir(tmp_path_factory.mktemp("input-fuzz"))) as srv:
        yield srv


def test_document_served_behind_the_key(server: Server) -> None:
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    r = httpx.get(server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200 and r.json() == openapi_document()


def closed(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (False if k == "additionalProperties" and v is True else closed(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [closed(v) for v in node]
    return node


def check(response: Any, path: str, took: float) -> None:
    status = response.status_code
    SEEN[(path, status)] += 1
    assert status < 500, (path, status, response.text[:500])
    assert took < BOUND_S, (path, took)
    if status < 400:
        return
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_fuzz(server: Server, operation: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_dict(closed(openapi_document()))
    method, path = operation.split()
    op = schema[path][method].ok() if hasattr(schema[path][method], "ok") else schema[path][method]
    if mode is GenerationMode.NEGATIVE and method == "GET":
        pytest.skip("no parameters to violate")

    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        started = time.perf_counter()
        response = case.call(base_url=server.url, headers=AUTH, timeout=30)
        check(response, path, time.perf_counter() - started)

    run()


def test_summary(server: Server) -> None:
    """Answers by route and status (printed with -s), and that the fuzz reached the turn itself (200s),
    not only the validation in front of it."""
    if not SEEN:
        pytest.skip("prints the figures of the fuzz above; none ran")
    for (path, status), n in sorted(SEEN.items()):
        print(f"{path:24s} {status}  {n}")
    assert not [k for k in SEEN if k[1] >= 500]
    assert SEEN[("/v1/chat/completions", 200)] > 0 and SEEN[("/v1/messages", 200)] > 0
