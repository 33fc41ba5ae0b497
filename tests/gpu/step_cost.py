"""Step cost of gpu-long's layers in vLLM's own classes, plugin off vs on, on the H200.

    python3 -m tests.gpu.step_cost [--batch 1 2] [--context 100000] [--accepted 8] [--json PATH]

Two stacks of 16 attention + 48 GDN layers (tests/gpu/rig.py; one built before the plugin is
registered, one after), each step a FULL CUDA graph captured as vLLM captures it (T = 1 + k
tokens per request, contexts of `--context`, every request accepting `--accepted` tokens of the
previous step).  Timed side by side in one process, alternating off / on in every round: the
median of CUDA-event-timed graph replays, each after a 256 MiB read that evicts the L2.  Rows:

* attention layer: one `Attention` (KV write + attention), as the model calls it;
* GDN core: vLLM's `qwen_gdn_attention_core` op of one layer (conv + delta rule), where the
  plugin's lazy commit lives; GDN layer: the whole `QwenGatedDeltaNetAttention` forward
  (bf16 projections, core, gated norm, out_proj);
* step: all 16 + 48 layers as the model calls them, and the cores only (16 attention + 48 GDN
  cores: what the plugin changes);
* align postprocess (patch 0003's host sync): vLLM's `run_fused_postprocess` for the 48 GDN
  layers, host wall time per call on an idle GPU, without and with a block-boundary copy, and
  the CPU time it blocks right after a step's graph launch (plugin on syncs; off does not).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tests.gpu import rig as r

FLUSH_BYTES = 256 << 20


def time_replays(fns: dict[str, callable], reps: int, rounds: int) -> dict[str, float]:
    """Median µs of each fn (a graph replay), cold L2, the fns alternating within each round."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda").normal_()
    sink = torch.empty((), device="cuda")
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for start, end in ev:
                sink.copy_(flush.sum())  # reads 256 MiB: the L2 holds none of the step's bytes
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times[name] += [s.elapsed_time(e) * 1e3 for s, e in ev]
    return {k: statistics.median(v) for k, v in times.items()}


class Case:
    """One captured graph of `module` on a stack, replayable without host work."""

    def __init__(self, stack: r.Stack, module, inputs: tuple, step: r.StepInputs) -> None:
        self.stack, self.module, self.inputs, self.step = stack, module, inputs, step
        stack.run(module, inputs, step, graph=True)  # capture + first replay
        torch.cuda.synchronize()
        self.graph = stack.graphs[(id(module), tuple(step.tokens))]

    def __call__(self) -> None:
        # The metadata buffers are persistent and already hold this step: replay only.
        entry = next(iter(self.graph.concrete_cudagraph_entries.values()))
        entry.cudagraph.replay()


def build_cases(stack: r.Stack, batch: int, context: int, accepted: int) -> dict[str, Case]:
    eng = stack.engine
    T = 1 + eng.num_spec
    N = batch * T
    H, D, Hkv = r.Q_HEADS, eng.shape.head_dim, eng.shape.kv_heads
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(N, n, generator=g, device="cuda", dtype=eng.dtype) for n in (H * D, Hkv * D, Hkv * D))
    hidden = torch.randn(N, r.HIDDEN_SIZE, generator=g, device="cuda", dtype=eng.dtype) * 0.1
    gdn0 = stack.gdn_layers[0]
    dim = 2 * gdn0.num_k_heads * gdn0.head_k_dim + gdn0.num_v_heads * gdn0.head_v_dim
    mixed = torch.randn(N, dim, generator=g, device="cuda", dtype=eng.dtype)
    b_in, a_in = (torch.randn(N, gdn0.num_v_heads, generator=g, device="cuda", dtype=eng.dtype) for _ in range(2))
    outs = [torch.empty(N, gdn0.num_v_heads, gdn0.head_v_dim, device="cuda", dtype=eng.dtype)
            for _ in stack.gdn_layers]
    step = r.StepInputs(context=[context - 37 * i for i in range(batch)], tokens=[T] * batch,
                        num_accepted=[accepted] * batch)
    one = _Sub(stack, attn=1, gdn=1)
    return {
        "attention layer": Case(stack, r.AttentionStep(one), (q, k, v), step),
        "GDN core": Case(stack, r.GdnCoreStep(one, outs[:1]), (mixed, b_in, a_in), step),
        "GDN layer": Case(stack, _GdnLayers(one), (hidden,), step),
        "step: 16 attn + 48 GDN cores": Case(stack, _Cores(stack, outs), (q, k, v, mixed, b_in, a_in), step),
        "step: 16 attn + 48 GDN layers": Case(stack, r.LayerStep(stack), (q, k, v, hidden), step),
    }


class _Sub:
    """The first layers of a stack (same KV cache, builders and metadata)."""

    def __init__(self, stack: r.Stack, attn: int, gdn: int) -> None:
        self.attn_layers, self.gdn_layers = stack.attn_layers[:attn], stack.gdn_layers[:gdn]


class _GdnLayers(torch.nn.Module):
    def __init__(self, stack) -> None:
        super().__init__()
        self.layers = stack.gdn_layers

    def forward(self, hidden):
        return [layer(hidden) for layer in self.layers]


class _Cores(torch.nn.Module):
    def __init__(self, stack: r.Stack, outs) -> None:
        super().__init__()
        self.attn, self.gdn = r.AttentionStep(stack), r.GdnCoreStep(stack, outs)

    def forward(self, q, k, v, mixed, b, a):
        return self.attn(q, k, v) + self.gdn(mixed, b, a)


def postprocess_cost(stack: r.Stack, batch: int, context: int, accepted: int, step_case: Case,
                     reps: int = 20) -> dict[str, float]:
    """Host µs of vLLM's align postprocess (`MambaSpecDecodeGPUContext.run_fused_postprocess`,
    patch 0003's hook for the plugin's layers) over the stack's GDN layers."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils

    eng = stack.engine
    funcs = {MambaAttentionBackendEnum.GDN_ATTN: (get_conv_copy_spec, get_temporal_copy_spec)}

    def make_buffer(*size, dtype):
        return CpuGpuBuffer(*size, dtype=dtype, device=eng.device, with_numpy=True)

    ctx = mamba_utils.MambaSpecDecodeGPUContext.create(stack.max_reqs, stack.kv_config, funcs, eng.device,
                                                       make_buffer)
    layers = {layer.prefix: layer for layer in stack.gdn_layers} | {a.layer_name: a for a in stack.attn_layers}
    tables = [g.block_table for g in stack.groups if not g.is_attention]
    ctx.initialize_from_forward_context(stack.kv_config, layers, funcs, tables)
    T = 1 + eng.num_spec
    bs = next(g.spec.block_size for g in stack.groups if not g.is_attention)
    seq = [context - 37 * i + T for i in range(batch)]
    state_idx = torch.tensor([(s - 1) // bs for s in seq], dtype=torch.int32, device="cuda")
    acc = torch.full((batch,), accepted, dtype=torch.int32, device="cuda")
    sched = torch.full((batch,), T, dtype=torch.int32, device="cuda")
    drafts = torch.full((batch,), T - 1, dtype=torch.int32, device="cuda")

    def call(computed: list[int]) -> float:
        comp = torch.tensor(computed, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctx.run_fused_postprocess(batch, acc, state_idx, sched, comp, drafts)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e6

    # No boundary: the step's accepted tokens stay inside the scheduler block.
    inside = [(s - T) for s in seq]
    # A boundary inside the accepted tokens: new computed count crosses a block multiple.
    crossing = [((s - T) // bs + 1) * bs - accepted // 2 - 1 for s in seq]
    out = {
        "postprocess, idle GPU, no boundary": statistics.median(call(inside) for _ in range(reps)),
        "postprocess, idle GPU, boundary copy": statistics.median(call(crossing) for _ in range(reps)),
    }
    blocked = []
    for _ in range(reps):
        comp = torch.tensor(inside, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        step_case()  # the step's graph is queued: a runner's CPU would now run ahead
        t0 = time.perf_counter()
        ctx.run_fused_postprocess(batch, acc, state_idx, sched, comp, drafts)
        blocked.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    out["postprocess right after the step's launch (CPU blocked)"] = statistics.median(blocked)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--accepted", type=int, default=8, help="tokens each request accepted last step (1..1+k)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    eng = r.Engine("gpu-long", max_model_len=args.context + 352)
    batch_max = max(args.batch)
    stacks = {"off": r.Stack(eng, "off", attn=16, gdn=48, max_reqs=batch_max, max_context=args.context, seed=1)}
    r.enable_plugin()
    stacks["on"] = r.Stack(eng, "on", attn=16, gdn=48, max_reqs=batch_max, max_context=args.context, seed=1)
    for st in stacks.values():
        st.assign_blocks(seed=3)
        st.fill_random(seed=5)  # the same contents in both stacks
    print(json.dumps(r.describe(eng)), flush=True)
    rows: dict = {}
    for batch in args.batch:
        cases = {n: build_cases(st, batch, args.context, args.accepted) for n, st in stacks.items()}
        for row in cases["off"]:
            t = time_replays({n: cases[n][row] for n in stacks}, args.reps, args.rounds)
            rows[(batch, row)] = t
            print(f"b={batch} {row:32s} off {t['off']:10.1f} µs  on {t['on']:10.1f} µs  off/on {t['off'] / t['on']:6.2f}x",
                  flush=True)
        pp: dict = {}
        for n, st in stacks.items():
            try:
                pp = postprocess_cost(st, batch, args.context, args.accepted, cases[n]["step: 16 attn + 48 GDN layers"])
            except Exception as exc:  # noqa: BLE001 - a failed row is reported, the table goes on
                print(f"b={batch} postprocess ({n}) FAILED: {exc!r}", flush=True)
                continue
            for k, v in pp.items():
                rows.setdefault((batch, k), {})[n] = v
        for k in [k for (b, k) in rows if b == batch and len(rows[(b, k)]) == 2 and k.startswith("postprocess")]:
            t = rows[(batch, k)]
            print(f"b={batch} {k:54s} off {t['off']:9.1f} µs  on {t['on']:9.1f} µs", flush=True)
    print("\n| batch | row | plugin off µs | plugin on µs | off / on |")
    print("|---|---|---|---|---|")
    for (batch, row), t in rows.items():
        if len(t) == 2:
            print(f"| {batch} | {row} | {t['off']:,.1f} | {t['on']:,.1f} | {t['off'] / t['on']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({f"{b}|{k}": v for (b, k), v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
