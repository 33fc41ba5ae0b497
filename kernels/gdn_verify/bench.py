"""Benchmark: GDN verify step per layer on the GPU (CUDA-graph replay, L2 flushed before each).

    python -m kernels.gdn_verify.bench [--vllm-ref .vllm_ref] [--baseline .baseline]

Providers (Qwen3.5-27B GDN shapes: H=16, HV=48, K=V=128, T=8 verify tokens):
  ours r=T / r=3   lazy commit, replaying T (all accepted) or 3 tokens of the previous step's log
  before r=T       the same launch through an earlier copy of kernels/gdn_verify/triton.py
                   (``--baseline`` folder, ignored by git; 86a6d8f: raw k|v|a|b log, replay
                   recomputes gates and k.h), for before/after ratios in one run
  vllm eager       vLLM 0.32.0's fused_sigmoid_gating_delta_rule_update (1 state read, T writes),
                   copied into an ignored folder (never committed); skipped when absent
  fla 1 call       fla-core's fused_recurrent_gated_delta_rule over the T tokens (1 read, 1 fp32
                   write, cannot resume from a rejected token); gates fused in-kernel
  fla T x 1        T one-token fla calls (resumable the naive way)
Tiling sweeps: ``python -m kernels.gdn_verify.diag --sweep``.
Bytes are what each provider must move (state, log, inputs, outputs); "%bw" is bytes/time over the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import triton

from kernels.gdn_verify import (
    fused_recurrent_gdn_verify_eager,
    gdn_log_empty,
    log_layout,
)
from kernels.gdn_verify.triton import gdn_verify_fwd
from kernels.timing import time_graph

H, HV, K, V = 16, 48, 128, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB after a warm-up, bytes read + written per second."""
    src = torch.randn(256 << 20, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):
        dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
    for st, en in ev:
        st.record()
        dst.copy_(src)
        en.record()
    torch.cuda.synchronize()
    ms = statistics.median(st.elapsed_time(en) for st, en in ev)
    return 2 * src.numel() * 4 / (ms * 1e-3)


@triton.jit
def _empty_kernel(x):
    pass


def load_vllm(ref_dir: Path):
    path = ref_dir / "fused_sigmoid_gating.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("vllm_fused_sigmoid_gating", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fused_sigmoid_gating_delta_rule_update


def load_baseline(base_dir: Path):
    """gdn_verify_fwd of an earlier kernels/gdn_verify/triton.py saved as base_dir/gdn_verify_triton.py."""
    path = base_dir / "gdn_verify_triton.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("gdn_verify_triton_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gdn_verify_fwd


def load_fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return fused_recurrent_gated_delta_rule


def inputs(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), a=r(B, T, HV), b=r(B, T, HV),
                A_log=torch.rand(HV, device="cuda", generator=g) - 0.5,
                dt_bias=torch.randn(HV, device="cuda", generator=g) * 0.5)


def io_bytes(B: int, T: int) -> int:
    return B * T * (2 * H * K + 2 * HV * V + 2 * HV) * 2  # q, k, v, o, a, b in bf16


def old_log_row() -> int:
    """Row of the raw k | v | a | b log (86a6d8f and earlier), for the before column."""
    return H * K + HV * V + 2 * HV


def case_ours(B, T, sd, r, config=None, state_vk=False, fwd=None):
    """Ours lazy, replaying r tokens; ``fwd``: an earlier kernel's launcher (raw k|v|a|b bf16 log)."""
    x = inputs(B, T)
    state = (torch.randn(B + 1, HV, K, V, device="cuda") * 0.05).to(sd)
    if fwd is None:
        log = gdn_log_empty(B + 1, T, H, K, HV, V, torch.bfloat16, "cuda")
        row_bytes = log_layout(H, K, HV, V, torch.bfloat16).row_bytes
    else:
        log = torch.empty(B + 1, 2, T, old_log_row(), dtype=torch.bfloat16, device="cuda")
        row_bytes = old_log_row() * 2
    slots = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
    par = torch.zeros(1, dtype=torch.int32, device="cuda")
    zero = torch.zeros(B, dtype=torch.int32, device="cuda")
    launch = fwd or gdn_verify_fwd
    # the previous step, same config
    launch(**x, state=state, init_idx=slots, num_k_heads=H, log=log, log_parity=par,
           num_replay=zero, config=config, state_vk=state_vk)
    par ^= 1  # the log of the step above is now the previous step's
    replay = torch.full((B,), r, dtype=torch.int32, device="cuda")
    o = torch.empty(B, T, HV, V, dtype=torch.bfloat16, device="cuda")

    def fn():
        launch(**x, state=state, init_idx=slots, num_k_heads=H, log=log, log_parity=par,
               num_replay=replay, out=o, config=config, state_vk=state_vk)

    nbytes = B * HV * V * K * sd.itemsize * (1 + (r > 0)) + B * (r + T) * row_bytes + io_bytes(B, T)
    return fn, nbytes


def case_vllm(vllm_fn, B, T, sd):
    """vLLM's spec path: request n owns T slots spec_state_indices[n]; it starts from column
    num_accepted - 1 and writes the state after token t into column t (slot 0 is vLLM's null)."""
    x = inputs(B, T)
    state = (torch.randn(1 + B * T, HV, V, K, device="cuda") * 0.05).to(sd)
    idx = (1 + torch.arange(B * T, device="cuda", dtype=torch.int32)).view(B, T)
    acc = torch.full((B,), T, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.int32)
    q, k, v = (x[n].view(1, B * T, *x[n].shape[2:]) for n in "qkv")
    a, b = x["a"].view(B * T, HV), x["b"].view(B * T, HV)

    def fn():
        vllm_fn(x["A_log"], a, b, x["dt_bias"], q, k, v, initial_state=state, inplace_final_state=True,
                cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True)

    nbytes = B * HV * V * K * sd.itemsize * (1 + T) + io_bytes(B, T)
    return fn, nbytes


def compare_vllm(vllm_fn, B: int, T: int, sd: torch.dtype) -> str:
    """Our eager kernel (on vLLM's [V, K] layout) against vLLM's on the same data."""
    x = inputs(B, T, seed=1)
    state = (torch.randn(1 + B * T, HV, V, K, device="cuda") * 0.05).to(sd)
    ours = state.clone()
    idx = (1 + torch.arange(B * T, device="cuda", dtype=torch.int32)).view(B, T)
    acc = torch.randint(1, T + 1, (B,), device="cuda", dtype=torch.int32)
    cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.int32)
    o_v, _ = vllm_fn(x["A_log"], x["a"].view(B * T, HV), x["b"].view(B * T, HV), x["dt_bias"],
                     *(x[n].view(1, B * T, *x[n].shape[2:]) for n in "qkv"), initial_state=state,
                     inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx,
                     num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True)
    init = idx.gather(1, (acc - 1).long()[:, None]).squeeze(1).contiguous()
    o_o = fused_recurrent_gdn_verify_eager(**x, state=ours, init_indices=init, token_indices=idx, state_vk=True)
    do = (o_v.view_as(o_o).float() - o_o.float()).abs().max().item()
    ds = (state.float() - ours.float()).abs().max().item()
    same = torch.equal(o_v.view_as(o_o), o_o) and torch.equal(state, ours)
    return f"outputs max|d| {do:.2e}, states max|d| {ds:.2e}, bit-identical: {same}"


def case_fla(fla_fn, B, T, sd, steps):
    x = inputs(B, T)
    h0 = (torch.randn(B, HV, K, V, device="cuda") * 0.05).to(sd)
    Tc = T // steps
    chunks = [{n: x[n][:, s * Tc : (s + 1) * Tc].contiguous() for n in "qkvab"} for s in range(steps)]

    def fn():
        h = h0
        for c in chunks:
            _, h = fla_fn(c["q"], c["k"], c["v"], g=c["a"], beta=c["b"], initial_state=h,
                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                          use_beta_sigmoid_in_kernel=True)

    nbytes = B * HV * V * K * (sd.itemsize + 4) * steps + io_bytes(B, T)
    return fn, nbytes


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--vllm-ref", type=Path, default=Path(".vllm_ref"))
    ap.add_argument("--baseline", type=Path, default=Path(".baseline"))
    args = ap.parse_args()
    T, batches = args.T, [int(b) for b in args.batches.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s")
    vllm_fn, fla_fn, old_fn = load_vllm(args.vllm_ref), load_fla(), load_baseline(args.baseline)
    if old_fn is None:
        print("baseline kernel copy not found: before column skipped")
    if vllm_fn is None:
        print("vLLM kernel copy not found: vllm column skipped")
    if fla_fn is None:
        print("fla-core not importable: fla columns skipped")
    if vllm_fn is not None:
        for name, sd in DTYPES.items():
            print(f"ours eager vs vLLM eager, B=3 {name} state: {compare_vllm(vllm_fn, 3, T, sd)}")
    dummy = torch.zeros(1, device="cuda")
    print(f"launch floor in this harness (one empty Triton kernel): {time_graph(lambda: _empty_kernel[(1,)](dummy)):.2f} µs")
    cols = ["ours r=T", "ours r=3", "vllm eager", "fla 1 call", f"fla {T}x1", "before r=T"]
    print(f"\nGDN verify, T={T}, H={H} HV={HV} K={K} V={V}; µs per layer (CUDA graph, cold L2: memset-flushed, flush time subtracted); "
          f"[GB/s, %copy-bw]")
    print(f"{'B':>2} {'state':>5} | " + " | ".join(f"{c:>22}" for c in cols)
          + " | vllm/ours, ours/fla, before/ours")
    for B in batches:
        for name, sd in DTYPES.items():
            cases = [case_ours(B, T, sd, T), case_ours(B, T, sd, 3)]
            cases.append(case_vllm(vllm_fn, B, T, sd) if vllm_fn else None)
            cases.append(case_fla(fla_fn, B, T, sd, 1) if fla_fn else None)
            cases.append(case_fla(fla_fn, B, T, sd, T) if fla_fn else None)
            cases.append(case_ours(B, T, sd, T, fwd=old_fn) if old_fn else None)
            us, cells = [], []
            for c in cases:
                if c is None:
                    us.append(float("nan"))
                    cells.append(f"{'-':>22}")
                    continue
                t = time_graph(c[0])
                us.append(t)
                gbs = c[1] / (t * 1e-6) / 1e9
                cells.append(f"{t:7.1f} [{gbs:6.0f}, {100 * gbs * 1e9 / bw:3.0f}%]")
            print(f"{B:>2} {name:>5} | " + " | ".join(cells)
                  + f" | {us[2] / us[0]:.2f}x, {us[0] / us[3]:.2f}x, {us[5] / us[0]:.2f}x", flush=True)
    print("\nbytes floor at copy bandwidth (ours, r=T), µs: "
          + ", ".join(f"B={B} {case_ours(B, T, torch.float32, T)[1] / bw * 1e6:.1f}" for B in batches))


if __name__ == "__main__":
    sys.exit(main())
