"""The MTP drafter's vocabulary, counted from the model's own outputs.

A drafted token outside the drafter's vocabulary is a certain rejection, and every row of lm_head the
drafter scores costs bandwidth, so the drafter scores only the ids this model actually emits (the
seeds: 40,960 ids counted from its own outputs cover 97.5% of them, against 92.1% for a vocabulary
counted from web text, worth ~10% of throughput).

  1. `collect`: each prompt of a shipped set (prompts/<set>.jsonl) goes to a running server of the
     model (its chat endpoint, the model's own sampling defaults, `return_token_ids`);
  2. the prompts split 9:1 by a hash of their id: the outputs of nine tenths are counted, the tenth
     is held out;
  3. `choose`: every special (added) token of the tokenizer, then the most frequent other ids, up to
     exactly `size` ids (a multiple of 64: Marlin's tile; padded with the lowest unseen ids when the
     outputs held fewer);
  4. `coverage`: the share of output tokens, held out and counted, whose id is in the vocabulary.
`add_draft_head` then gives a prepared checkpoint the drafter's head: the vocabulary's rows of the
(int8, packed) lm_head as `mtp.draft_lm_head.*` and `mtp.draft_vocab_ids`, read by patch 0008.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
HELD_OUT_EVERY = 10
TILE = 64  # Marlin's output tile: the draft head's row count must be a multiple of it


def load_prompts(prompt_set: str) -> list[dict]:
    path = PROMPTS_DIR / f"{prompt_set}.jsonl"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl")))
        raise FileNotFoundError(f"no prompt set {prompt_set!r} (known: {known})")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out(prompt_id: str) -> bool:
    return int(hashlib.sha256(prompt_id.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def special_ids(model_dir: Path) -> list[int]:
    """The tokenizer's added tokens (chat markers, <think>, <tool_call>, ...), from tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    return sorted({int(t["id"]) for t in tok.get("added_tokens", [])})


@dataclass(frozen=True)
class Output:
    prompt_id: str
    token_ids: tuple[int, ...]


def collect(base_url: str, model: str, prompts: list[dict], *, max_tokens: int, api_key: str | None = None,
            concurrency: int = 8, timeout: float = 600.0,
            progress: Callable[[int], None] | None = None) -> list[Output]:
    """Each prompt's completion token ids from a running vLLM (or the proxy) at `base_url`."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"

    def one(client: httpx.Client, p: dict) -> Output:
        body = {"model": model, "messages": p["messages"], "max_tokens": max_tokens, "return_token_ids": True}
        try:
            r = client.post(url, json=body, headers=headers)
        except httpx.RemoteProtocolError:
            # the server closed a pooled connection as the request went out (nothing was generated
            # for it): once more on a fresh connection
            r = client.post(url, json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} for prompt {p['id']}: {r.text[:300]}")
        ids = r.json()["choices"][0].get("token_ids")
        if ids is None:
            raise RuntimeError(f"{url} returned no token_ids: the server must be vLLM >= 0.11 (return_token_ids)")
        if progress:
            progress(1)
        return Output(p["id"], tuple(int(i) for i in ids))

    # keepalive_expiry below vLLM's (uvicorn's) 5 s keep-alive: we drop an idle connection before the
    # engine does, so a request is never written into a connection the engine is closing
    limits = httpx.Limits(max_connections=concurrency, keepalive_expiry=3.0)
    with httpx.Client(timeout=timeout, limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: one(client, p), prompts))


def choose(counts: Counter, specials: list[int], size: int, vocab_size: int) -> list[int]:
    """Exactly `size` ids: the specials, the most frequent others (ties: the lower id), and, when the
    outputs held fewer distinct ids, the lowest ids not yet chosen (byte-level BPE ranks its most
    common merges first)."""
    if size % TILE:
        raise ValueError(f"draft vocabulary size {size} is not a multiple of {TILE}")
    if len(specials) > size or size > vocab_size:
        raise ValueError(f"a vocabulary of {size} cannot hold {len(specials)} specials within {vocab_size} ids")
    chosen = set(specials)
    for tid, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(tid)
    fill = iter(range(vocab_size))
    while len(chosen) < size:
        chosen.add(next(fill))
    return sorted(chosen)


def coverage(vocab: set[int], outputs: list[Output]) -> float:
    total = sum(len(o.token_ids) for o in outputs)
    hit = sum(t in vocab for o in outputs for t in o.token_ids)
    return hit / total if total else 0.0


def build(outputs: list[Output], specials: list[int], size: int, vocab_size: int, meta: dict) -> dict:
    train = [o for o in outputs if not held_out(o.prompt_id)]
    test = [o for o in outputs if held_out(o.prompt_id)]
    counts = Counter(t for o in train for t in o.token_ids)
    ids = choose(counts, specials, size, vocab_size)
    vocab = set(ids)
    filled = [t for t in ids if t not in set(specials) and t in counts]
    return {
        **meta, "size": len(ids), "ids": ids, "specials": specials,
        "prompts": {"counted": len(train), "held_out": len(test)},
        "tokens": {"counted": sum(counts.values()), "held_out": sum(len(o.token_ids) for o in test)},
        "distinct_ids_counted": len(counts),
        "filled_unseen": sum(t not in counts and t not in set(specials) for t in ids),
        "least_count_kept": min((counts[t] for t in filled), default=0),
        "coverage": {"held_out": coverage(vocab, test), "counted": coverage(vocab, train)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def vocab_path(cache: Path, prepared_name: str, prompt_set: str, size: int) -> Path:
    return cache / "draft-vocab" / f"{prepared_name}-{prompt_set}-{size}.json"


def vocab_size_of(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])
