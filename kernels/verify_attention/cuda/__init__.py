"""CUDA split-KV verify attention (verify_attention.cu beside this file), compiled at run time.

NVRTC through ``torch.cuda._compile_kernel`` (no nvcc or CUDA headers needed on the user's
machine; the kernel source includes no header: sm90_bulk.cuh's helpers are put in front of it),
for sm_90a (wgmma is arch-specific). The launcher's rule (NOTES.md, "Rules in force"):

* split kernel: verify_attn_decode (TMA page slices, warp streams) where a query tile holds at
  most 8 rows (one n8 tile: T=1 at G=6), the page size is a multiple of 16, the KV heads divide 8
  and the longest request spans DECODE_MIN_KEYS keys or more; else verify_attn_split_wg (wgmma),
  its tiles from a per-unit counter at one n8 tile ("dyn") and in static splits above;
* splits: ``num_splits_decode`` / ``num_splits_for`` unless the caller fixes them (CUDA graphs);
* combine (several splits): below 32 splits verify_attn_combine, from 32 to 256 the row combine
  after the wgmma kernel and the column combine (64 dims per CTA) after the decode kernel, past
  256 verify_attn_combine_w; launched with programmatic dependent launch after the decode kernel.

Each (kernel, head size, query tile, ring depth, dtype) variant is compiled once per process
(about 4 s), on its first call: call once eagerly before a CUDA-graph capture (vLLM's warm-up
does). Launches go to torch's current stream, so they are captured like any other kernel.

``supported`` says whether a call can take this path (sm_90, D in {128, 256}, the cache exactly in
vLLM 0.32.0's int8_per_token_head layout with 16-byte-aligned blocks and slots); the public
``kernels.verify_attention.verify_attention`` falls back to the Triton kernel otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("verify_attention.cu")
BULK_HELPERS = Path(__file__).with_name("sm90_bulk.cuh")  # put in front of the kernel source
THREADS = 128  # VA_THREADS in the .cu
BN = 64  # VA_BN: keys per tile
MAX_ROWS = 48  # query rows (tokens x GQA group) per CTA: 6 n8 tiles
CTAS_PER_SM = 2  # __launch_bounds__(128, 2); shared memory is sized for two per SM on sm_90
SHARED_PER_SM = 228 * 1024  # sm_90; 1 KB of it is reserved per CTA
LOG2E = 1.4426950408889634
HEAD_SIZES = (128, 256)
ROW_COMBINE_MAX_SPLITS = 256  # verify_attn_combine_r / _c keep every split's (max, sum) in shared memory
COMBINE_MIN_SPLITS = 32  # below: ea506d7's combine (combine_w's lanes idle at few splits)
COMBINE_COLS = 64  # dims per CTA of verify_attn_combine_c (4 CTAs per row at D = 256)
DECODE_WARPS = 8  # verify_attn_decode: consumer warps per CTA (warp w computes KV head w % Hkv)
# verify_attn_decode from this key span (the longest request's, window-limited): on the H200
# (session 9, fresh process, T=1) decode / wgmma is 1.08x at 100K b1, 1.17x at 100K b4, 1.12x at
# 200K b1, 1.04x at 50K, 1.01x at 32K, but 0.92x at 8K and 0.78-0.92x on the drafter's 2,048-key
# window layers: one CTA per SM over few keys pays its fixed costs.
DECODE_MIN_KEYS = 32_768


def smem_bytes_wg(d: int, n8: int, stages: int) -> int:
    """Dynamic shared memory of one verify_attn_split_wg CTA (ring, Q, P, maxima / sums, idx)."""
    rows = 8 * n8
    return stages * BN * (2 * d + 16) + rows * 2 * d + rows * 2 * BN + 5 * rows * 4 + 8 * 4


def smem_bytes_decode(d: int, hkv: int, stages: int) -> int:
    """Dynamic shared memory of one verify_attn_decode CTA: the ring of ``stages`` chunks (16 slots
    of every head) or the merge scratch that overlays it, whichever is larger, each head's Q^T
    fragments, the mbarriers and the stages' chunk indices (mirrors the carve-up in the .cu)."""
    ring = max(stages * 16 * hkv * (2 * d + 8), DECODE_WARPS * 8 * (d + 2) * 4)
    return ring + hkv * (d // 16) * 32 * 8 + 16 * stages + 4 * stages


def pick_stages(d: int, tiles: int, smem=smem_bytes_wg, ctas_per_sm: int = CTAS_PER_SM, most: int = 4) -> int:
    """Deepest ring (2..most) that still lets ctas_per_sm CTAs share an SM (1 KB of its shared
    memory is reserved per CTA); ``smem(d, tiles, stages)`` is the kernel's carve-up."""
    per_cta = SHARED_PER_SM // ctas_per_sm - 1024
    stages = 2
    while stages < most and smem(d, tiles, stages + 1) <= per_cta:
        stages += 1
    return stages


def pick_stages_decode(d: int, hkv: int) -> int:
    """Deepest ring (2..6 chunks) of one CTA per SM."""
    return pick_stages(d, hkv, smem_bytes_decode, ctas_per_sm=1, most=6)


def num_splits_decode(num_seqs: int, keys: int, sms: int) -> int:
    """verify_attn_decode's splits per request: one CTA per SM over the batch (a CTA holds every
    KV head), at least 16 keys per stream (8 warps)."""
    return max(1, min(max(1, sms // max(1, num_seqs)), -(-keys // (16 * DECODE_WARPS))))


def default_sched(n8: int) -> str:
    """The wgmma kernel's tile schedule: "dyn" (tiles from a per-unit counter) at one n8 tile of
    query rows, "static" above. H200: T=1 100K b1 74.8 vs 76.9 µs with dyn (the CTAs' end spread
    5 -> 3 µs); T=8 dyn was 104.4 vs 100.7 µs (session 4), and 85.6 vs 85.6 in session 10."""
    return "dyn" if n8 == 1 else "static"


def default_decode(keys: int) -> bool:
    """verify_attn_decode instead of the wgmma kernel where a query tile holds at most 8 rows:
    from DECODE_MIN_KEYS keys of the longest request's (window-limited) span."""
    return keys >= DECODE_MIN_KEYS


def default_pdl(decode: bool = False) -> bool:
    """Programmatic dependent launch of the combine (its CTAs start while the split kernel's last
    CTAs finish; it waits for the split grid's memory before reading the partials): after
    verify_attn_decode only. H200 (session 9, fresh process, T=1, 4 rounds) decode + col combine
    with / without PDL 58.7 / 59.7 µs at 100K b1, 103.8 / 104.6 at 200K b1, 28.4 / 29.1 at 32K;
    after the wgmma kernel session 5 measured -0.4 to -1.0 µs at T=1 but +5 µs with combine_w at
    T=8, session 10 85.4 vs 85.6 µs at T=8 (noise)."""
    return decode


def default_combine(decode: bool = False) -> str:
    """The combine kernel where 32..256 splits are merged: "col" (verify_attn_combine_c, CTA per
    row and COMBINE_COLS dims) after verify_attn_decode, "row" (verify_attn_combine_r, CTA per
    row, coalesced loads) after the wgmma kernel.

    row after the wgmma kernel: on the H200 (session 5, same run as combine_w, the previous
    default) 100K T=8 b1 90.8 vs 94.7 µs, 8K-32K T=8/16 b1 1.06-1.09x, T=1 b1 equal, no row of the
    full table slower than 1.03x; col there: no gain (T=1 72.9 vs 72.9 µs, T=8 91.0-92.8 vs 91.6;
    session 10: 87.2 vs 85.6 at T=8). col after the decode kernel (its 24 rows x 132 splits at T=1
    b1 over 96 CTAs instead of 24): with PDL 58.7 vs 61.1 µs (row + PDL) at 100K b1, 103.8 vs 106.2
    at 200K b1, 28.4 vs 30.5 at 32K (session 9)."""
    return "col" if decode else "row"


@functools.lru_cache(maxsize=None)
def _source() -> str:
    return BULK_HELPERS.read_text() + SOURCE.read_text()


@functools.lru_cache(maxsize=None)
def _compiled(name: str, smem: int) -> Any:
    # sm_90a: wgmma exists only in the arch-specific target (supported() admits sm_90 only).
    kernel = torch.cuda._compile_kernel(_source(), name, compute_capability="90a", nvcc_options=["-std=c++17"])
    if smem:
        if hasattr(kernel, "set_shared_memory_config"):
            kernel.set_shared_memory_config(smem)
        else:  # older torch: no helper and no check in the launcher
            _set_attr(kernel.func, 8, smem)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        # Prefer the largest shared-memory carve-out so two CTAs fit per SM.
        _set_attr(kernel.func, 9, 100)  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    return kernel


def precompile(jobs: list[tuple], workers: int = 16) -> int:
    """Compile ``_compiled`` variants [(name, smem)] in threads (NVRTC and the driver's
    PTX load release the GIL): a process that needs many variants (tests, bench) waits ~once.
    Returns how many compiled; a failure is left for the real call to raise."""
    import concurrent.futures

    dev = torch.cuda.current_device()

    def one(job: tuple) -> bool:
        torch.cuda.set_device(dev)  # the primary context, current in this thread
        try:
            _compiled(*job)
            return True
        except Exception:  # noqa: BLE001 - the launch compiles again and raises
            return False

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return sum(pool.map(one, list(dict.fromkeys(jobs))))


def split_variant(d: int, n8: int, bf16: bool, sched: str) -> tuple[str, int]:
    """(kernel name, dynamic shared memory) of the wgmma split kernel for these parameters."""
    stages = pick_stages(d, n8)
    dyn = "true" if sched == "dyn" else "false"
    name = f"verify_attn_split_wg<{d}, {n8}, {stages}, {'true' if bf16 else 'false'}, {dyn}>"
    return name, smem_bytes_wg(d, n8, stages)


# Per-device tile / chunk counters of the split kernels: int32, one per (request, query tile, KV
# head) unit (verify_attn_split_wg's dyn tiles) or per request (verify_attn_decode's chunk
# batches), zero between launches (each launch's last grab resets its counter). Allocated on the
# first (eager) call and grown only outside a CUDA-graph capture; launches using it must be
# ordered on one stream (two concurrent launches on different streams would share counters).
_COUNTERS: dict[int, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTERS.get(idx)
    if buf is None or buf.numel() < n:
        if buf is not None and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("verify_attention: tile counters must grow before graph capture")
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[idx] = buf
    return buf


def launch_combine(
    kind: str, out: torch.Tensor, part_acc: torch.Tensor, part_ml: torch.Tensor, pdl: bool = False,
    trace: torch.Tensor | None = None,
) -> None:
    """Merge the fp32 partials [N, Hq, S, D | 2] into out [N, Hq, D]. kind: "row"
    (verify_attn_combine_r), "col" (verify_attn_combine_c, COMBINE_COLS dims per CTA; ``trace``
    int64 [CTAs, 8] gets its %globaltimer stamps, diag.py), "w" (verify_attn_combine_w) or
    "legacy" (verify_attn_combine, ea506d7's)."""
    num_tokens, num_q_heads, num_splits, d = part_acc.shape
    bf16 = "true" if out.dtype == torch.bfloat16 else "false"
    rows = num_tokens * num_q_heads
    tail = [int(num_splits), num_q_heads, out.stride(0), out.stride(1)]
    if kind == "row":  # verify_attn_combine_r: CTA per row, coalesced loads (session 5)
        combine = _compiled(f"verify_attn_combine_r<{d}, {bf16}>", 0)
        grid, block, args = (rows, 1, 1), (256, 1, 1), [out, part_acc, part_ml] + tail
    elif kind == "col":  # verify_attn_combine_c: CTA per row and column block
        combine = _compiled(f"verify_attn_combine_c<{d}, {COMBINE_COLS}, {bf16}>", 0)
        grid, block = (rows * (d // COMBINE_COLS), 1, 1), (256, 1, 1)
        args = [out, part_acc, part_ml] + tail + [trace if trace is not None else out, int(trace is not None)]
    elif kind == "w":
        combine = _compiled(f"verify_attn_combine_w<{d}, {bf16}>", 0)
        grid, block = (math.ceil(rows * (d // 8) / 4), 1, 1), (128, 1, 1)
        args = [out, part_acc, part_ml] + tail + [rows]
    elif kind == "legacy":  # ea506d7's combine, below COMBINE_MIN_SPLITS splits
        combine = _compiled(f"verify_attn_combine<{d}, {bf16}>", 0)
        grid, block, args = (rows, 1, 1), (256, 1, 1), [out, part_acc, part_ml] + tail
    else:
        raise ValueError(f"combine kind {kind!r}: row, col, w or legacy")
    if pdl:
        _launch_pdl(combine, grid, block, args)
    else:
        combine(grid=grid, block=block, args=args)


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint),
    ]  # fmt: skip


def _launch_pdl(kernel: Any, grid: tuple, block: tuple, args: list, shared_mem: int = 0) -> None:
    """cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1 on
    torch's current stream: the kernel may start before the previous one on the stream ends (it
    must call griddepcontrol.wait before reading that kernel's output). Arguments are marshalled
    as torch's launcher does (tensor -> pointer, int -> int32, float -> double)."""
    keep, ptrs = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, int):
            c = ctypes.c_int(a)
        elif isinstance(a, float):
            c = ctypes.c_double(a)
        else:
            raise TypeError(f"unsupported argument {type(a)}")
        keep.append(c)
        ptrs.append(ctypes.cast(ctypes.byref(c), ctypes.c_void_p))
    params = (ctypes.c_void_p * len(ptrs))(*ptrs)
    attr = _LaunchAttr()
    attr.id = 6
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttr.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    cfg = _LaunchConfig()
    cfg.grid[:] = list(grid)
    cfg.block[:] = list(block)
    cfg.shared = shared_mem
    cfg.stream = torch.cuda.current_stream().cuda_stream
    cfg.attrs = ctypes.pointer(attr)
    cfg.num_attrs = 1
    libcuda = _libcuda()
    err = libcuda.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err}")


@functools.lru_cache(maxsize=None)
def _libcuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _set_attr(func: Any, attr: int, value: int) -> None:
    libcuda = ctypes.CDLL("libcuda.so.1")
    err = libcuda.cuFuncSetAttribute(func, ctypes.c_int(attr), ctypes.c_int(value))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute({attr}, {value}) failed: CUresult {err}")


def _tile(group: int, max_seqlen_q: int) -> tuple[int, int, int]:
    """(tokens per query tile, query tiles, n8 tiles) for a request of max_seqlen_q."""
    block_q = max(1, min(max(1, max_seqlen_q), MAX_ROWS // group))
    rows = block_q * group
    return block_q, math.ceil(max(1, max_seqlen_q) / block_q), math.ceil(rows / 8)


def supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
) -> bool:
    """Can this call run the CUDA kernel? (Shapes were validated by the caller.)"""
    if not q.is_cuda or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    n, hq, d = q.shape
    hkv = k.shape[2]
    if d not in HEAD_SIZES or q.dtype not in (torch.bfloat16, torch.float16) or hq // hkv > MAX_ROWS:
        return False
    rec = 2 * d + 8
    kp = k.data_ptr()
    if k.shape[3] != d + 4 or v.data_ptr() - kp != d + 4:
        return False
    # The record layout of vLLM 0.32.0's int8_per_token_head cache (NHD), blocks and slots 16-byte
    # aligned, so every record starts 0 or 8 bytes into a 16-byte window (one shift per head).
    if k.stride(2) != rec or k.stride(1) != hkv * rec or k.stride(1) % 16 or k.stride(0) % 16:
        return False
    if kp % 16 or k.stride(0) >= 2**31:
        return False
    # The wgmma kernel exchanges a key's window offset as 32 bits in 16-byte units: pool < 64 GB.
    if k.shape[0] * k.stride(0) >= 2**36:
        return False
    for t, off in ((k_scale_cache, d), (v_scale_cache, 2 * d + 4)):
        if t.data_ptr() != kp + off or tuple(4 * s for s in t.stride()) != tuple(k.stride()[:3]):
            return False
    # q / out rows are read and written 8 bytes at a time.
    for t in (q, out):
        if t.data_ptr() % 8 or t.stride(0) % 4 or t.stride(1) % 4 or t.stride(2) != 1:
            return False
    return True


def num_splits_for(
    num_seqs: int, num_kv_heads: int, num_q_tiles: int, keys: int, sms: int
) -> int:
    """KV splits per (request, KV head, query tile): the fewest waves x tiles per CTA.

    Cost model: waves of CTAS_PER_SM x sms CTAs, each wave as long as its CTAs' tiles plus about
    two tiles of fixed cost (Q load, epilogue, the partials). At least 4 tiles per split."""
    slots = CTAS_PER_SM * sms
    units = num_seqs * num_kv_heads * num_q_tiles
    best_cost, best = None, 1
    for s in range(1, max(1, math.ceil(keys / (4 * BN))) + 1):
        tiles = math.ceil(math.ceil(keys / s) / BN)
        cost = math.ceil(units * s / slots) * (tiles + 2)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, s
    return best


def verify_attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    window: int,
    block_table: torch.Tensor,
    num_splits: int | None = None,
    *,
    decode: bool | None = None,
    sched: str | None = None,
    combine_kernel: str | None = None,
    pdl: bool | None = None,
    combine: bool = True,
    trace: torch.Tensor | None = None,
    combine_trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch; the contract is ``kernels.verify_attention.verify_attention``'s (window = W or 0).

    The keywords override one choice of the launcher's rule (None: the rule), so tests and
    diag.py can run every path the rule uses on any shape: ``decode`` verify_attn_decode where
    a query tile holds at most 8 rows (None: ``default_decode(keys)``); ``sched`` the wgmma
    kernel's "dyn" / "static" tiles (None: ``default_sched(n8)``); ``combine_kernel`` "row" /
    "col" / "w" where 32..256 splits are merged (None: ``default_combine(decode)``); ``pdl`` the
    combine's programmatic dependent launch (None: ``default_pdl(decode)``). Timing only:
    ``combine=False`` skips the merge of the partials (out is then not written); ``trace`` /
    ``combine_trace``: int64 [CTAs, 8] buffers for the split / column-combine kernels' per-CTA
    %globaltimer stamps."""
    num_tokens, num_q_heads, d = q.shape
    num_seqs = seqused_k.shape[0]
    hkv = k.shape[2]
    group = num_q_heads // hkv
    block_q, n_qt, n8 = _tile(group, max_seqlen_q)
    keys = max_seqlen_k if window <= 0 else min(max_seqlen_k, window + block_q)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if num_splits is None else 0
    bf16 = "true" if q.dtype == torch.bfloat16 else "false"
    # The decode kernel's 16-key chunks are whole pages' slices (page sizes that are multiples of
    # 16), and its 8 warps stream every KV head (1, 2, 4 or 8 of them).
    dec = (n8 == 1 and k.shape[1] % 16 == 0 and DECODE_WARPS % hkv == 0
           and (default_decode(keys) if decode is None else decode))  # fmt: skip
    if dec:  # same arguments (the first 24), same partials; a chunk-batch counter per request
        if num_splits is None:
            num_splits = num_splits_decode(num_seqs, keys, sms)
        stages = pick_stages_decode(d, hkv)
        smem = smem_bytes_decode(d, hkv, stages)
        split_kernel = _compiled(f"verify_attn_decode<{d}, {stages}, {hkv}, {bf16}>", smem)
    else:
        if num_splits is None:
            num_splits = num_splits_for(num_seqs, hkv, n_qt, keys, sms)
        sched = (sched or default_sched(n8)) if num_splits > 1 else "static"
        name, smem = split_variant(d, n8, bf16 == "true", sched)
        split_kernel = _compiled(name, smem)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, num_splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused: one split writes out
    # The decode kernel's chunk-batch counter per request; the wgmma kernel's dyn tile counter per
    # (request, query tile, KV head) unit (any tensor with static tiles).
    if dec:
        ctr = _counters(q.device, num_seqs)
    else:
        ctr = _counters(q.device, num_seqs * n_qt * hkv) if sched == "dyn" else out
    split_kernel(
        grid=((1 if dec else hkv) * n_qt * num_splits, num_seqs, 1),
        block=(32 * (DECODE_WARPS + 1) if dec else THREADS, 1, 1),
        args=[
            q, k, block_table, seqused_k, cu_seqlens_q, out, part_acc, part_ml,
            float(softmax_scale * LOG2E), int(window), int(num_splits), n_qt, block_q, group,
            k.shape[1], hkv, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), k.stride(2), block_table.stride(0),
            ctr, trace if trace is not None else out, int(trace is not None),
        ],
        shared_mem=smem,
    )  # fmt: skip
    if num_splits > 1 and num_tokens and combine:
        if COMBINE_MIN_SPLITS <= num_splits <= ROW_COMBINE_MAX_SPLITS:
            kind = combine_kernel or default_combine(dec)
        else:
            kind = "w" if num_splits >= COMBINE_MIN_SPLITS else "legacy"
        launch_combine(kind, out, part_acc, part_ml, default_pdl(dec) if pdl is None else pdl, combine_trace)
    return out
