"""Pure-read ceiling probes (ceiling_stream.cu) for the int8 per-token-head cache (issue 6).

``bench.py --ceiling-only`` times them beside the split-grid probe of ceiling.py. Unlike that
probe they do not mimic a kernel: they read the bytes of one request's context (batch 1, no
window, 4 KV heads x D = 256) as fast as the layout lets a plain streaming read, so their best
time bounds what any kernel over this layout can reach on the device (a lower bound of the
layout's read time, measured, not a proof: each probe is itself one design).

Probe kinds (``Probe.kind``):
* ``tma``: persistent grid, cp.async.bulk of TOK-slot units (TOK x 2,080 contiguous bytes) into a
  STAGES-deep shared-memory ring, consumer warps add the words from shared memory.
* ``ld``: 16-byte ld.global.nc loads over whole pages (all heads), UNROLL in flight per thread.
* ``head``: the split kernel's per-head 528-byte windows with the ``ld`` loop (one head per CTA).

Every probe writes one wrapping 32-bit word sum per warp into ``sink``; ``expected_sum`` is the
same sum computed by torch over the same bytes, so a run proves the probe read exactly them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.verify_attention import cuda as vc
from kernels.verify_attention.reference import Int8KVCache

SOURCE = Path(__file__).with_name("ceiling_stream.cu")


def _source() -> str:
    """The probes' source after the shared mbarrier / TMA helpers (no include path in NVRTC)."""
    return vc.BULK_HELPERS.read_text() + SOURCE.read_text()


SLOT_BYTES = 2080  # 4 KV heads x 520-byte records: the only layout the probes are written for
REC_WORDS = 130  # 32-bit words per 520-byte record
# Words a head probe reads twice per slot: its 528-byte windows of heads 0 and 1 (and 2 and 3)
# overlap by 16 bytes at bytes 512..527 and 1552..1567 of the slot.
OVERLAP_WORDS = (slice(128, 132), slice(388, 392))
MAX_SMEM = 227 * 1024  # sm_90 dynamic shared memory per CTA


@dataclass(frozen=True)
class Probe:
    """One probe configuration. ``per_sm``: CTAs per SM (grid = per_sm x SMs)."""

    kind: str  # "tma" | "ld" | "head"
    per_sm: int
    tok: int = 0  # tma: slots per bulk copy
    stages: int = 0  # tma: ring depth
    unroll: int = 0  # ld / head: 16-byte loads in flight per thread
    grid_stride: bool = False  # ld: chunks grid-strided instead of one range per CTA
    hint: bool = False  # ld: .L2::256B prefetch-size qualifier

    @property
    def label(self) -> str:
        if self.kind == "tma":
            return f"tma tok{self.tok} st{self.stages} x{self.per_sm}/SM"
        extra = (" gs" if self.grid_stride else "") + (" L2::256B" if self.hint else "")
        return f"{self.kind} u{self.unroll} x{self.per_sm}/SM{extra}"

    def kernel(self, page: int) -> tuple[str, int]:
        """(NVRTC name expression, dynamic shared memory bytes)."""
        if self.kind == "tma":
            smem = self.stages * self.tok * SLOT_BYTES
            return f"va_ceil_tma<{self.tok}, {self.stages}, 4>", smem
        if self.kind == "ld":
            b = {True: "true", False: "false"}
            name = f"va_ceil_ld<{page}, {self.unroll}, {self.per_sm}, {b[self.grid_stride]}, {b[self.hint]}>"
            return name, 0
        return f"va_ceil_ld_head<{page}, {self.unroll}, {self.per_sm}>", 0


DEFAULT_PROBES = (
    Probe("tma", 1, tok=8, stages=12),
    Probe("tma", 1, tok=16, stages=6),
    Probe("tma", 2, tok=8, stages=6),
    Probe("tma", 2, tok=4, stages=12),
    Probe("ld", 4, unroll=8),
    Probe("ld", 8, unroll=4),
    Probe("ld", 2, unroll=16),
    Probe("ld", 4, unroll=8, grid_stride=True),
    Probe("ld", 4, unroll=8, hint=True),
    Probe("head", 4, unroll=8),
    Probe("head", 8, unroll=4),
)


def jobs(probes: tuple[Probe, ...], pages: tuple[int, ...]) -> list[tuple[str, int, str]]:
    """``vc.precompile`` jobs for these probes at these page sizes."""
    src = _source()
    return [(*p.kernel(page), src) for p in probes for page in pages]


def launcher(
    p: Probe, pool: Int8KVCache, block_table: torch.Tensor, ctx: int
) -> tuple[Callable[[], None], torch.Tensor]:
    """(run, sink) for probe ``p`` over keys [0, ctx) of block_table[0] (int32 [1, pages])."""
    page, stride_blk = pool.block_size, pool.k.stride(0)
    if pool.k.shape[2] * pool.k.shape[3] * 2 != SLOT_BYTES or pool.k.stride(1) != SLOT_BYTES:
        raise ValueError("the probes are written for 4 KV heads x D = 256 (2,080-byte slots)")
    if p.kind == "tma" and (page % p.tok or p.stages * p.tok * SLOT_BYTES * p.per_sm > 2 * MAX_SMEM):
        raise ValueError(f"{p.label}: TOK must divide the page and the ring fit in shared memory")
    sms = torch.cuda.get_device_properties(block_table.device).multi_processor_count
    grid = sms * p.per_sm
    warps = 4 if p.kind == "tma" else 8
    sink = torch.zeros(grid * warps, dtype=torch.int32, device=block_table.device)
    name, smem = p.kernel(page)
    kernel = vc._compiled(name, smem, _source())
    kv, bt = pool.raw, block_table[0].contiguous()
    threads = 160 if p.kind == "tma" else 256

    def run() -> None:
        args = [kv, bt, ctx, page, stride_blk, sink] if p.kind == "tma" else [kv, bt, ctx, stride_blk, sink]
        kernel(grid=(grid, 1, 1), block=(threads, 1, 1), args=args, shared_mem=smem)

    return run, sink


def sink_sum(sink: torch.Tensor) -> int:
    return int(sink.long().sum().item()) & 0xFFFFFFFF


def expected_sum(pool: Int8KVCache, block_table: torch.Tensor, ctx: int, head: bool) -> int:
    """Wrapping 32-bit word sum of the bytes a probe reads: every slot of keys [0, ctx) of
    block_table[0]; ``head``: plus the 16-byte window overlaps read twice."""
    storage = pool.raw.untyped_storage().nbytes()
    words = pool.raw.as_strided((storage,), (1,)).view(torch.int32)
    blk_words = pool.k.stride(0) // 4
    blocks = words[: storage // 4 // blk_words * blk_words].view(-1, blk_words)
    page = pool.block_size
    n_pages = -(-ctx // page)
    slots = blocks[block_table[0, :n_pages].long(), : page * 4 * REC_WORDS]
    slots = slots.reshape(n_pages * page, 4 * REC_WORDS)[:ctx].long()  # [ctx, 520]
    total = int(slots.sum().item())
    if head:
        total += sum(int(slots[:, s].sum().item()) for s in OVERLAP_WORDS)
    return total & 0xFFFFFFFF


def read_bytes(ctx: int, head: bool) -> int:
    """Bytes the probe loads from device memory (the head probe's 528-byte windows)."""
    return ctx * (4 * 528 if head else SLOT_BYTES)
