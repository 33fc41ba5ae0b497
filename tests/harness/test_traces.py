"""The recorded harness traces (tests/traces/*.jsonl, written by test_real_harnesses and committed from one
run) play in the replay tool, and the recording -> trace conversion keeps a session's turns and sides."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from proxy.app import create_app
from backend.tools.replay import load_trace, replay
from proxy.settings import Settings
from proxy.store.memory import MemoryStore
from tests.harness.rig import Exchange
from tests.harness.traces import shapes, to_replay_trace
from tests.proxy.fake_format import ToyFormat
from tests.proxy.fake_vllm import FakeVLLM, fake_vllm_server, serve_app

pytestmark = [pytest.mark.unit]
TRACES = sorted((Path(__file__).resolve().parents[1] / "traces").glob("*.jsonl"))
SYSTEM = {"role": "system", "content": "You are an agent."}


def test_traces_are_committed() -> None:
    assert {p.stem for p in TRACES} >= {"dsh", "pi", "hermes"}


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_shape(path: Path) -> None:
    events = load_trace(path)
    assert "start" in events[0]
    assert any("turn" in e for e in events), "a recorded session has a second turn"


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
async def test_trace_replays(path: Path) -> None:
    fake = FakeVLLM(max_model_len=200_000)
    async with fake_vllm_server(fake) as upstream:
        app = create_app(Settings(upstream=upstream, model_name="hh"), fmt=ToyFormat(), store=MemoryStore())
        async with serve_app(app) as url:
            out = io.StringIO()
            summary = await replay([path], url, model="hh", gap_s=0, warmup=False, out=out)
    totals = summary[path.name]["proxy"]
    assert totals["diverged"] == 0, out.getvalue()  # every turn extended the previous prompt + output


def _ex(messages: list[dict[str, object]], **extra: object) -> Exchange:
    return Exchange("POST", "/v1/chat/completions", {"x-harness": "pi", "session_id": "s"},
                    {"model": "m", "messages": messages, "max_tokens": 32, **extra}, status=200)


def test_conversion_turns_and_sides() -> None:
    user1 = {"role": "user", "content": [{"type": "text", "text": "task"}]}
    reply = {"role": "assistant", "content": "Done."}
    user2 = {"role": "user", "content": "next"}
    summary = [{"role": "system", "content": "You are a context summarization assistant."},
               {"role": "user", "content": "<conversation>...</conversation>"}]
    exchanges = [_ex([SYSTEM, user1]), _ex(summary), _ex([SYSTEM, user1, reply, user2])]
    events = [json.loads(line) for line in to_replay_trace("pi", exchanges).splitlines()]
    assert events[0]["start"]["user"] == "task" and events[0]["start"]["headers"] == {"x-harness": "pi",
                                                                                      "session_id": "s"}
    assert events[1] == {"session": "pi", "side": {"user": "<conversation>...</conversation>", "max_tokens": 32}}
    assert events[2] == {"session": "pi", "turn": {"max_tokens": 32, "user": "next"}}
    assert [s["turn"] for s in shapes(exchanges, 2)] == [1, 1, 2]


def test_conversion_of_anthropic_requests() -> None:
    body = {"model": "m", "max_tokens": 48, "system": "sys", "thinking": {"type": "enabled"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "task"}]}]}
    ex = Exchange("POST", "/v1/messages", {"x-deepseek-harness-session-id": "d"}, body, status=200)
    (event,) = [json.loads(line) for line in to_replay_trace("dsh", [ex]).splitlines()]
    assert event["start"]["system"] == "sys" and event["start"]["user"] == "task"
