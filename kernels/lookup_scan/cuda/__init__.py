"""CUDA lookup scan: one thread-block cluster per request (lookup_scan.cu beside this file).

NVRTC through ``torch.cuda._compile_kernel`` (no nvcc or CUDA headers on the user's machine), for
sm_90 (clusters and distributed shared memory).  Each (cluster size, threads, n range, k, index
dtypes) variant is compiled once per process on its first call: call once eagerly before a
CUDA-graph capture (vLLM's warm-up does).  The launch goes to torch's current stream.

Same contract and proposals as the Triton kernel (kernels.lookup_scan.triton); no workspace.
``supported`` says whether a call can take this path; ``kernels.lookup_scan.lookup_scan`` picks it
where config.CUDA_RULE says it is faster and falls back to Triton otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("lookup_scan.cu")
POS_BITS = 26  # packed score m << 26 | e + 1, as triton.py
MAX_SMEM = 227 * 1024  # sm_90: dynamic shared memory one CTA may opt into
PORTABLE_CLUSTER = 8  # larger clusters need the non-portable attribute (sm_90 allows 16)


def chunk_tokens(capacity: int, cluster: int) -> int:
    """End positions per CTA: the buffer's positions [0, S - 1) over the cluster, in 4-token vectors."""
    return 4 * math.ceil(max(capacity - 1, 1) / (4 * cluster))


def smem_bytes(capacity: int, cluster: int, max_n: int, num_draft: int) -> int:
    """Dynamic shared memory of one CTA: its slice with the halo before and the draft tail after."""
    halo = 4 * math.ceil((max_n - 1) / 4)
    tail = 4 * math.ceil(num_draft / 4)
    return 4 * (halo + chunk_tokens(capacity, cluster) + tail)


def supported(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor | None,
    max_n: int,
    num_draft: int,
    cluster: int = 16,
) -> bool:
    """Whether this call can take the cluster kernel: an sm_90+ device, int32 histories in 16-byte
    aligned rows, 32-bit index tensors or int64 ones, and a slice that fits in shared memory."""
    if not token_ids.is_cuda or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(token_ids.device)[0] < 9:
        return False
    if token_ids.dtype != torch.int32 or token_ids.dim() != 2 or token_ids.stride(1) != 1:
        return False
    if token_ids.data_ptr() % 16 or token_ids.stride(0) % 4 or token_ids.stride(0) >= 2**31:
        return False
    if token_ids.shape[1] >= 2**POS_BITS or max_n > 31 or num_draft > 32:
        return False
    for t in (seq_lens, req_indices):
        if t is not None and (t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous()):
            return False
    return smem_bytes(token_ids.shape[1], cluster, max_n, num_draft) <= MAX_SMEM


@functools.lru_cache(maxsize=None)
def _source() -> str:
    return SOURCE.read_text()


@functools.lru_cache(maxsize=None)
def _compiled(cluster: int, threads: int, min_n: int, max_n: int, num_draft: int, has_req: bool,
              req64: bool, len64: bool) -> Any:
    defs = dict(LS_C=cluster, LS_THREADS=threads, LS_MIN_N=min_n, LS_MAX_N=max_n, LS_K=num_draft,
                LS_HAS_REQ=int(has_req), LS_REQ64=int(req64), LS_LEN64=int(len64))
    kernel = torch.cuda._compile_kernel(
        _source(), "lookup_scan_cluster", compute_capability="90a",
        nvcc_options=["-std=c++17", *(f"-D{k}={v}" for k, v in defs.items())],
    )
    if cluster > PORTABLE_CLUSTER:
        _set_attr(kernel.func, 14, 1)  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    return kernel


def _set_attr(func: Any, attr: int, value: int) -> None:
    libcuda = ctypes.CDLL("libcuda.so.1")
    err = libcuda.cuFuncSetAttribute(func, ctypes.c_int(attr), ctypes.c_int(value))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute({attr}, {value}) failed: CUresult {err}")


def lookup_scan_cuda(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    min_n: int,
    max_n: int,
    num_draft: int,
    req_indices: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    cluster: int = 16,
    threads: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster launch: B clusters of ``cluster`` CTAs x ``threads`` threads.

    token_ids: [R, S] int32 (16-byte aligned rows); seq_lens: [R] int32/int64 (<= S);
    req_indices: optional [B] int32/int64 rows; out: optional (drafts [B, num_draft] int64,
    num_valid [B] int32).  Returns (drafts, num_valid) as kernels.lookup_scan.lookup_scan."""
    if not 1 <= min_n <= max_n or num_draft < 1:
        raise ValueError(f"need 1 <= min_n <= max_n and num_draft >= 1, got {min_n}, {max_n}, {num_draft}")
    if cluster not in (1, 2, 4, 8, 16) or threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"cluster must be 1/2/4/8/16 and threads a multiple of 32 <= 1024, got {cluster}, {threads}")
    if not supported(token_ids, seq_lens, req_indices, max_n, num_draft, cluster):
        raise ValueError("lookup_scan_cuda: unsupported call (see kernels.lookup_scan.cuda.supported)")
    S = token_ids.shape[1]
    B = token_ids.shape[0] if req_indices is None else req_indices.shape[0]
    dev = token_ids.device
    drafts, num_valid = out if out is not None else (
        torch.empty(B, num_draft, dtype=torch.int64, device=dev),
        torch.empty(B, dtype=torch.int32, device=dev),
    )
    if B == 0:
        return drafts, num_valid
    kernel = _compiled(cluster, threads, min_n, max_n, num_draft, req_indices is not None,
                       req_indices is not None and req_indices.dtype == torch.int64,
                       seq_lens.dtype == torch.int64)
    smem = smem_bytes(S, cluster, max_n, num_draft)
    if smem >= 48 * 1024 and smem > getattr(kernel, "_max_shared_mem_bytes", 0):
        _set_attr(kernel.func, 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        kernel._max_shared_mem_bytes = smem  # torch's launcher checks it from 48 KB up
    kernel(
        grid=(B * cluster, 1, 1), block=(threads, 1, 1),
        args=[token_ids, req_indices if req_indices is not None else seq_lens, seq_lens, drafts, num_valid,
              token_ids.stride(0), S, chunk_tokens(S, cluster)],
        shared_mem=smem,
    )
    return drafts, num_valid
