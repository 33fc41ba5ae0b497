"""A real harness' own subagent fan-out through the proxy: DeepSeek Harness (`dsh headless`, its native
Anthropic route) asked to delegate three tasks calls its `subagent` tool three times, and dsh itself runs
the three children as sessions of their own.

The model's replies are scripted: a stand-in engine that speaks vLLM's /v1/completions stream with token
ids (tests/proxy/fake_vllm.py) answers each request by what its prompt holds — the parent's first turn
with three `subagent` calls in the Qwen3.x XML tool format, everything else with a short final answer —
so the harness, its tool loop, its child sessions and the proxy (rendering, parsing, transcripts,
admission) are all real. Checked:

- the children's requests carry the parent link the proxy recognizes (dsh puts it in `dsh_session_log`,
  proxy/sessions.py reads it) and each child is a session of its own with the parent's id as parent;
- they are admitted by pool geometry as subagents (the scheduler's admission counter, by class);
- with two engines behind the proxy, each child lands on its parent's engine (the `proxy.routing`
  placement log line, written by the placement policy of the scale-out work).
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from proxy.app import create_app
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.tokenizer import TiktokenTokenizer
from proxy.settings import EngineGeometry, Settings, UpstreamConfig
from proxy.store.memory import MemoryStore
from tests.harness.drivers import DRIVERS, binary
from tests.harness.rig import KEY, Recorder, Rig, adapters_install, run_cli
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.harness, pytest.mark.asyncio(loop_scope="session")]

MODEL = "tiny-qwen-hybrid"
MARK = "FANOUT-PARENT"
TASKS = ("count the files in src", "list the open issues", "summarize the README")
TASK = (f"{MARK}: delegate these three independent tasks to subagents, one subagent each, then stop: "
        + "; ".join(TASKS) + ".")
TIMEOUT_S = 300
# A small pool on purpose: 4 seats, room for a few sessions at this test's prompt sizes.
GEOMETRY = EngineGeometry(seats=4, max_model_len=65536, block_size=16, pool_blocks=32768)


def _call(task: str) -> str:
    return (f"<tool_call>\n<function=subagent>\n<parameter=description>\n{task}\n</parameter>\n"
            f"<parameter=prompt>\nPlease {task}. Reply with one word: done.\n</parameter>\n</function>\n"
            "</tool_call>")


@dataclass
class ScriptedVLLM(FakeVLLM):
    """Chooses each reply from the request's prompt: the parent's first turn -> three `subagent` calls;
    any turn after a tool result, and every child -> a short final answer."""

    fmt: Any = None
    name: str = "engine"

    def reply_for(self, prompt_ids: list[int]) -> str:
        text = self.fmt.tokenizer.decode(prompt_ids)
        if MARK in text and "<tool_response>" not in text:
            return "</think>\n\n" + "\n".join(_call(t) for t in TASKS)
        return "</think>\n\nDone."

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = self.fmt.tokenizer.encode(self.reply_for(body["prompt"])) + sorted(self.fmt.stop_token_ids)
        self.scripts.insert(0, (ids, [self.fmt.tokenizer.decode([i]) for i in ids], "stop"))
        return await super()._completions(request)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@asynccontextmanager
async def fanout_rig(tmp: Path, engines: int) -> AsyncIterator[tuple[Rig, list[ScriptedVLLM]]]:
    fmt = Qwen3xFormat(TiktokenTokenizer.qwen36())
    fakes = [ScriptedVLLM(model_id=MODEL, max_model_len=65536, fmt=fmt, name=f"engine-{i}") for i in range(engines)]
    async with _servers(fakes) as urls:
        ups = tuple(UpstreamConfig(name=f.name, url=u, geometry=GEOMETRY) for f, u in zip(fakes, urls, strict=True))
        app = create_app(Settings(upstreams=ups, model_name=MODEL, api_key=KEY), fmt=fmt, store=MemoryStore())
        recorder = Recorder(app)
        key_file = tmp / "proxy.key"
        key_file.write_text(KEY + "\n")
        async with serve_app(recorder) as url:
            yield Rig(url, app, recorder, None, key_file), fakes


@asynccontextmanager
async def _servers(fakes: list[ScriptedVLLM]) -> AsyncIterator[list[str]]:
    if not fakes:
        yield []
        return
    async with fake_vllm_server(fakes[0]) as first, _servers(fakes[1:]) as rest:
        yield [first, *rest]


async def run_fanout(rig: Rig, tmp: Path) -> Any:
    """dsh, configured by our adapter for its native route, runs the delegating task headless."""
    driver = DRIVERS["dsh-native"]
    exe = await asyncio.to_thread(binary, driver.client)
    log = tmp / "dsh-cli.log"
    home = driver.config_home(tmp)
    installed = await adapters_install(driver.adapter, rig, home, max_output=1024, log=log)
    assert installed.returncode == 0, installed.stderr
    driver.after_install(home, rig.url + "/v1", MODEL)
    patches = yaml.safe_load((home / "cordis.patch.yml").read_text())
    for p in patches:  # three tool calls do not fit the two-turn test's 48-token cap
        if p.get("id") == "llm-deepseek":
            p["config"]["maxTokens"] = 1024
    (home / "cordis.patch.yml").write_text(yaml.safe_dump(patches, sort_keys=False))
    work = tmp / "work"
    work.mkdir()
    run = await run_cli([str(exe), "headless", "--json", TASK], env=driver.env(tmp), cwd=work, timeout_s=TIMEOUT_S,
                        log=log)
    assert run.returncode == 0, f"dsh failed (see {log}):\n{run.stderr[-3000:]}"
    return run


def children_of(rig: Rig) -> tuple[str, list[Any], list[Any]]:
    """(the parent's session id, the parent's requests, the children's requests) from the proxy's log."""
    infos = rig.quirk_log()
    assert {i.harness for i in infos} == {"dsh"}, [i.harness for i in infos]
    kids = [i for i in infos if i.parent is not None]
    assert kids, ("no request carried a parent link the proxy recognizes: dsh 0.2.1rc2 sends it as "
                  "dsh_session_log.session.parentSession (with origin: subagent), which proxy/sessions.py "
                  "dsh_log_ids must read")
    parent_ids = {i.parent for i in kids}
    assert len(parent_ids) == 1, parent_ids
    (parent,) = parent_ids
    mains = [i for i in infos if i.session.key == f"h:{parent}"]
    assert mains, f"the children's parent {parent} sent no request of its own"
    return parent, mains, kids


async def subagent_admissions(rig: Rig) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(rig.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    found = re.findall(r'^hh_scheduler_admitted_total\{[^}]*priority="subagent"[^}]*\} ([0-9.e+]+)',
                       text, re.M)
    return sum(map(float, found))


async def test_dsh_subagents_carry_the_parent_link_and_are_admitted_as_subagents(tmp_path: Path) -> None:
    async with fanout_rig(tmp_path, engines=1) as (rig, fakes):
        before = await subagent_admissions(rig)
        await run_fanout(rig, tmp_path)
        await rig.recorder.settle()
        calls = rig.recorder.model_calls()
        assert calls and all(c.status == 200 for c in calls), [(c.path, c.status) for c in calls]
        parent, mains, kids = children_of(rig)
        child_sessions = {k.session.key for k in kids}
        assert len(child_sessions) == len(TASKS), child_sessions  # three children, a session each
        assert f"h:{parent}" not in child_sessions
        assert all(k.priority.label == "subagent" for k in kids), [k.priority for k in kids]
        assert all(m.priority.label == "interactive" for m in mains[:1])
        # each child was admitted by the scheduler against the engine's pool geometry, as a subagent
        assert await subagent_admissions(rig) - before >= len(child_sessions)
        # the engine saw each child's own task (the harness really delegated what the model asked)
        prompts = [fakes[0].fmt.tokenizer.decode(r["prompt"]) for r in fakes[0].requests]
        for task in TASKS:
            assert any(f"Please {task}." in p and MARK not in p for p in prompts), task


async def test_dsh_subagents_land_with_their_parent_over_two_engines(tmp_path: Path) -> None:
    """Over two engines, every child of a DeepSeek Harness session is placed on its parent's engine
    (read from the placement lines the router logs on `proxy.routing`)."""
    handler = Lines()
    logger = logging.getLogger("proxy.routing")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with fanout_rig(tmp_path, engines=2) as (rig, fakes):
            await run_fanout(rig, tmp_path)
            await rig.recorder.settle()
            _, _, kids = children_of(rig)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    line = re.compile(r"placement session=(\S+) parent=(\S+) engine=(\S+) reason=(\w+) reprefill=(\d+)")
    placements = [m.groups() for m in map(line.search, handler.lines) if m]
    assert placements, "no `proxy.routing` placement lines"
    engine_of = {s: e for s, p, e, _, _ in placements if p == "-"}
    child_lines = [(s, p, e, r) for s, p, e, r, _ in placements if p != "-"]
    assert len({s for s, _, _, _ in child_lines}) >= len({k.session.key for k in kids}), placements
    assert len({p for _, p, _, _ in child_lines}) == 1, child_lines  # one parent, as the proxy read it
    for session, parent_hash, engine, reason in child_lines:
        assert parent_hash in engine_of, f"child {session}'s parent {parent_hash} was never placed: {placements}"
        assert engine == engine_of[parent_hash], (session, engine, engine_of[parent_hash], reason)
    # and both engines really served: the parent's engine got the children, the other none of them
    busy = {f.name for f in fakes if f.requests}
    assert set(engine_of.values()) <= busy
