"""H200 sweep for the gdn_verify defaults: (BV, num_warps) per state dtype and batch, with the
vLLM / fla anchors of bench.py in the same run and a per-config correctness check.

    python -m kernels.gdn_verify.sweep [--batches 1,4,8]

Each line: µs per layer (bench.time_graph: CUDA graph, cold L2) of ours (lazy, r=T) for each
config, then max|d| of that config's outputs and states against config 8/1 after two steps.
"""

from __future__ import annotations

import argparse

import torch

from kernels.gdn_verify import fused_recurrent_gdn_verify, gdn_log_empty
from kernels.gdn_verify.bench import (
    DTYPES, H, HV, K, V, case_fla, case_ours, case_vllm, copy_bandwidth, inputs, load_fla,
    load_vllm, time_graph,
)  # fmt: skip
from kernels.gdn_verify.triton import _default_config, gdn_verify_fwd

CFGS = {
    "bf16": [(8, 1), (16, 1), (32, 1), (16, 2), (32, 2), (32, 4)],
    "fp16": [(8, 1), (16, 1), (32, 1), (32, 2)],
    "fp32": [(8, 1), (16, 1), (32, 1), (32, 2)],
}


def two_steps(B, T, sd, cfg):
    """Outputs and state after a first step (no replay) and a second one replaying T tokens."""
    x1, x2 = inputs(B, T, seed=3), inputs(B, T, seed=4)
    g = torch.Generator(device="cuda").manual_seed(5)
    state = (torch.randn(B + 1, HV, K, V, device="cuda", generator=g) * 0.05).to(sd)
    log = gdn_log_empty(B + 1, T, H, K, HV, V, torch.bfloat16, "cuda")
    slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
    par = torch.zeros(1, dtype=torch.int32, device="cuda")
    gdn_verify_fwd(**x1, state=state, init_idx=slots, num_k_heads=H, log=log, log_parity=par,
                   num_replay=torch.zeros(B, dtype=torch.int32, device="cuda"), config=cfg)
    par ^= 1
    o = gdn_verify_fwd(**x2, state=state, init_idx=slots, num_k_heads=H, log=log, log_parity=par,
                       num_replay=torch.full((B,), T, dtype=torch.int32, device="cuda"), config=cfg)
    return o.float(), state.float()


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,4,1")
    ap.add_argument("--T", type=int, default=8)
    args = ap.parse_args()
    T = args.T
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s", flush=True)
    vllm_fn, fla_fn = load_vllm(__import__("pathlib").Path(".vllm_ref")), load_fla()
    print(f"vllm ref: {vllm_fn is not None}  fla: {fla_fn is not None}", flush=True)
    assert fused_recurrent_gdn_verify is not None
    for B in (int(b) for b in args.batches.split(",")):
        for name in ("bf16", "fp16", "fp32"):
            sd = DTYPES[name]
            o0, s0 = two_steps(B, T, sd, (8, 1))
            cells = []
            for cfg in CFGS[name]:
                try:
                    t = time_graph(case_ours(B, T, sd, T, config=cfg)[0])
                    o, s = two_steps(B, T, sd, cfg)
                    d = max((o - o0).abs().max().item(), (s - s0).abs().max().item())
                    cells.append(f"{'/'.join(map(str, cfg))} {t:.1f} (d {d:.0e})")
                except Exception as e:  # noqa: BLE001
                    cells.append(f"{'/'.join(map(str, cfg))} ERR {type(e).__name__}")
            tv = time_graph(case_vllm(vllm_fn, B, T, sd)[0]) if vllm_fn else float("nan")
            tf = time_graph(case_fla(fla_fn, B, T, sd, 1)[0]) if fla_fn else float("nan")
            print(f"B={B} {name} default={_default_config(B, sd)} | " + "  ".join(cells)
                  + f" | vllm {tv:.1f}  fla1 {tf:.1f}", flush=True)


if __name__ == "__main__":
    main()
