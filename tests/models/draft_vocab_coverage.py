"""Coverage of draft vocabularies of several sizes, from one collection of a model's own outputs.

    python -m tests.models.draft_vocab_coverage --base-url URL --model NAME --model-dir DIR \
        [--sizes 512,1024,2048,4096] [--max-tokens 64] [--prompt-set agent]

Sends the shipped prompt set once through a running server, then for each size prints the share of
the held-out tenth's output tokens (and the counted nine tenths') whose id the vocabulary holds, beside
the same share for as many ids in BPE rank order (the tokenizer's corpus-frequency order: what a
vocabulary not counted from the model gives), and one JSON line with the same figures.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from backend.models import draft_vocab as dv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-dir", type=Path, required=True, help="for its tokenizer's specials and vocab size")
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-set", default="agent")
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    prompts = dv.load_prompts(a.prompt_set)
    t0 = time.monotonic()
    outputs = dv.collect(a.base_url, a.model, prompts, max_tokens=a.max_tokens, concurrency=a.concurrency)
    took = time.monotonic() - t0
    specials, vocab_size = dv.special_ids(a.model_dir), dv.vocab_size_of(a.model_dir)
    held = [o for o in outputs if dv.held_out(o.prompt_id)]
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        v = dv.build(outputs, specials, size, vocab_size, {})
        rank = dv.coverage(set(dv.choose(Counter(), specials, size, vocab_size)), held)
        rows.append({"size": size, "held_out": v["coverage"]["held_out"], "counted": v["coverage"]["counted"],
                     "rank_order_held_out": rank, "distinct_counted": v["distinct_ids_counted"],
                     "filled_unseen": v["filled_unseen"]})
    v0 = dv.build(outputs, specials, rows[0]["size"], vocab_size, {})
    print(f"{a.model}: {len(prompts)} prompts ({v0['prompts']['held_out']} held out), "
          f"{v0['tokens']['counted']:,} counted / {v0['tokens']['held_out']:,} held-out output tokens, "
          f"{len(specials)} specials, vocabulary {vocab_size:,}, generation {took:.0f} s")
    print(f"{'size':>8} {'held-out (own outputs)':>23} {'held-out (rank order)':>22} {'counted':>9} "
          f"{'unseen fill':>12}")
    for r in rows:
        print(f"{r['size']:>8,} {r['held_out']:>23.2%} {r['rank_order_held_out']:>22.2%} {r['counted']:>9.2%} "
              f"{r['filled_unseen']:>12,}")
    print(json.dumps({"model": a.model, "prompts": len(prompts), "tokens": v0["tokens"], "rows": rows}))


if __name__ == "__main__":
    main()
