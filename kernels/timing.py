"""Kernel timing shared by the op benchmarks: CUDA-graph replays with a cold L2."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_graph(fn: Callable[[], object], n: int = 20, reps: int = 15) -> float:
    """µs per call, cold L2, from CUDA-graph replays: a graph of n x (96 MB memset, fn) minus a
    graph of n x (memset), median over reps replays each, divided by n.  Launch gaps inside a
    graph are included; the host-side graph launch is not."""
    scrub = torch.empty(96 << 20, dtype=torch.int8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                scrub.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    med = []
    for g in graphs:
        g.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for st, en in ev:
            st.record()
            g.replay()
            en.record()
        torch.cuda.synchronize()
        med.append(statistics.median(st.elapsed_time(en) * 1e3 for st, en in ev))
    return (med[0] - med[1]) / n
