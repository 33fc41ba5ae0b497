"""Lookup scan, CUDA cluster kernel (kernels/lookup_scan/cuda): proposals identical to the serial
reference.  The kernel needs an sm_90 GPU (clusters); on CPU only the launcher's rules run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernels.lookup_scan import config, cuda, naive_lookup_scan  # noqa: E402

pytestmark = pytest.mark.kernels
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
gpu = pytest.mark.skipif(not SM90, reason="the cluster kernel needs an sm_90 GPU")


def histories(B: int, S: int, seed: int) -> torch.Tensor:
    """Half quoting (vocab 150K, copied spans, a quoted suffix), half vocab 3 (hits everywhere)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 150_000, (B, S), generator=g, dtype=torch.int32)
    for i_b in range(B // 2):
        for _ in range(max(1, S // 200)):
            n = int(torch.randint(8, 40, (1,), generator=g))
            if S <= 2 * n + 2:
                break
            src, dst = sorted(int(x) for x in torch.randint(0, S - n, (2,), generator=g))
            tok[i_b, dst : dst + n] = tok[i_b, src : src + n].clone()
    tok[B // 2 :] = torch.randint(0, 3, (B - B // 2, S), generator=g, dtype=torch.int32)
    return tok


def run(tok, lens, min_n, max_n, k, req=None, cluster=16, threads=1024):
    B = tok.shape[0] if req is None else req.shape[0]
    out = (torch.full((B, k), -7, dtype=torch.int64, device="cuda"),
           torch.full((B,), -7, dtype=torch.int32, device="cuda"))  # unwritten outputs fail
    cuda.lookup_scan_cuda(tok.cuda() if not tok.is_cuda else tok, lens.cuda(), min_n, max_n, k,
                          None if req is None else req.cuda(), out, cluster, threads)
    return out[0].cpu(), out[1].cpu()


def reference(tok, lens, min_n, max_n, k, req=None):
    rows = torch.arange(tok.shape[0]) if req is None else req.cpu().long()
    return naive_lookup_scan(tok.cpu()[rows], lens.cpu()[rows], min_n, max_n, k)


@gpu
@pytest.mark.parametrize("cluster,threads", [(1, 128), (4, 256), (8, 1024), (16, 1024), (16, 96)])
@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 7), (2, 7, 1), (5, 5, 7), (6, 12, 7), (1, 31, 16)])
def test_odd_shapes(cluster, threads, min_n, max_n, k):
    """Odd capacity, lengths 0 / 1 / short / full / just under full: idle CTAs, slices that end
    inside a vector, drafts clipped at the history's end, rows with and without matches."""
    S = 4099
    tok = histories(8, S, seed=min_n * 100 + max_n)
    lens = torch.tensor([S, S - 1, S // 2 + 3, 1000, S, 0, 1, max_n + 1], dtype=torch.int32)
    d, n = run(tok, lens, min_n, max_n, k, cluster=cluster, threads=threads)
    dr, nr = reference(tok, lens, min_n, max_n, k)
    assert torch.equal(n, nr) and torch.equal(d, dr)


@gpu
@pytest.mark.parametrize("S", [8192, 100_000, 262_144])
@pytest.mark.parametrize("min_n,max_n", [(5, 5), (6, 12)], ids=str)
@pytest.mark.parametrize("cluster", [8, 16])
def test_real_lengths(S, min_n, max_n, cluster):
    tok = histories(8, S, seed=S)
    lens = torch.tensor([S, S - 1, S // 2 + 3, 1000, S, S - 5, 77, S // 3], dtype=torch.int32)
    d, n = run(tok, lens, min_n, max_n, 7, cluster=cluster)
    dr, nr = reference(tok, lens, min_n, max_n, 7)
    assert torch.equal(n, nr) and torch.equal(d, dr)


@gpu
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_rows_strides_and_index_dtypes(idx_dtype):
    """vLLM's layout: a wider buffer (row stride > S), rows picked by req_indices, int64 lengths."""
    S, R = 3001, 6
    big = torch.zeros(R, S + 13, dtype=torch.int32, device="cuda")[:, : S + 12]  # stride S + 13 is odd
    with pytest.raises(ValueError):
        cuda.lookup_scan_cuda(big[:, :S], torch.full((R,), S, device="cuda"), 2, 6, 7)
    buf = torch.zeros(R, S + 15, dtype=torch.int32, device="cuda")  # stride 3016: 16-byte rows
    tok = histories(R, S, seed=5)
    buf[:, :S] = tok.cuda()
    lens = torch.tensor([S, 2000, 5, S - 3, 1234, 64]).to(idx_dtype)
    req = torch.tensor([4, 0, 3, 1, 5]).to(idx_dtype)
    d, n = run(buf[:, :S], lens, 2, 6, 7, req=req)
    dr, nr = reference(tok, lens, 2, 6, 7, req=req)
    assert torch.equal(n, nr) and torch.equal(d, dr)


@gpu
def test_cuda_graph_replay():
    """One launch captured in a graph, replayed over new histories and lengths."""
    S, B = 20_000, 3
    tok = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = (torch.zeros(B, 7, dtype=torch.int64, device="cuda"), torch.zeros(B, dtype=torch.int32, device="cuda"))
    cuda.lookup_scan_cuda(tok, lens, 6, 12, 7, None, out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuda.lookup_scan_cuda(tok, lens, 6, 12, 7, None, out)
    for seed in (1, 2):
        h = histories(B, S, seed)
        ln = torch.tensor([S, S - seed * 100, 7 * seed], dtype=torch.int32)
        tok.copy_(h.cuda())
        lens.copy_(ln.cuda())
        out[0].fill_(-7)
        out[1].fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        dr, nr = naive_lookup_scan(h, ln, 6, 12, 7)
        assert torch.equal(out[1].cpu(), nr) and torch.equal(out[0].cpu(), dr)


@gpu
def test_public_entry_takes_the_cluster_kernel(monkeypatch):
    """HH_LOOKUP_BACKEND=cuda sends lookup_scan() to the cluster kernel; an int64 history is not
    supported there and goes to the Triton kernel, with the same proposals."""
    from kernels.lookup_scan import lookup_scan

    calls = []
    real = cuda.lookup_scan_cuda
    monkeypatch.setattr(cuda, "lookup_scan_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("HH_LOOKUP_BACKEND", "cuda")
    S = 5000
    tok = histories(4, S, seed=9)
    lens = torch.tensor([S, 4000, 3, S - 1], dtype=torch.int32)
    dr, nr = naive_lookup_scan(tok, lens, 5, 5, 7)
    for t, expect in ((tok, 1), (tok.long(), 0)):
        calls.clear()
        d, n = lookup_scan(t.cuda(), lens.cuda(), 5, 5, 7)
        assert len(calls) == expect
        assert torch.equal(n.cpu(), nr) and torch.equal(d.cpu(), dr)


def test_launch_rules_on_cpu():
    """The pure-Python parts: slices cover every end position, shared memory per CTA, the backend
    switch, and no CUDA path for CPU tensors."""
    for S in (1, 2, 5, 4099, 100_000, 262_144):
        for c in (1, 8, 16):
            ch = cuda.chunk_tokens(S, c)
            assert ch % 4 == 0 and c * ch >= S - 1 and (c - 1) * ch < max(S - 1, 1) + 4 * c
    assert cuda.smem_bytes(262_144, 16, 12, 7) == 4 * (12 + 16_384 + 8)
    assert not cuda.supported(torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32), None, 6, 7)
    assert config.cuda_choice(1, 100_000, "triton") is None
    assert config.cuda_choice(1, 10**9, "cuda") is not None
    with pytest.raises(ValueError):
        config.cuda_choice(1, 100, "gpu")
    for limit, cluster, threads in config.CUDA_RULE:
        assert config.cuda_choice(1, limit) == (cluster, threads)
