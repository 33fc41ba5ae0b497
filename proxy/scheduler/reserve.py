"""The room kept for interactive requests (the main agent), sized from what they were seen to use.

A fixed share of the pool either starves the subagents (a main agent that sends 2K-token turns does not
need a tenth of a 100K pool) or fails the main agent (one that sends 40K-token turns needs more). So the
reserve is the peak the interactive class held at once (blocks, worst case, and seats) over the last
`window_s`; before any interactive request is seen, and after the window passes with none, the
configured prior (`reserve_fraction`, `reserve_seats`) stands in. Bounded by `reserve_max_fraction`, so
a main agent that once sent a huge prompt does not lock the subagents out of most of the pool.

The reserve is headroom *beyond* what interactive requests hold now: while the main agent runs, its
blocks are already counted as used, so the others are kept out only of `reserve - held`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reserve:
    blocks: int
    seats: int


class DemandReserve:
    def __init__(self, prior_fraction: float, prior_seats: int, window_s: float, max_fraction: float) -> None:
        self.prior_fraction = prior_fraction
        self.prior_seats = prior_seats
        self.window_s = window_s
        self.max_fraction = max_fraction
        self._peaks: deque[tuple[float, int, int]] = deque()  # (when, interactive blocks held, seats held)

    def observe(self, blocks_held: int, seats_held: int, now: float | None = None) -> None:
        """Record what the interactive class holds right after admitting one of its requests."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        # Keep only entries that can still be the window's peak (a monotone deque per dimension would be
        # exact; two dimensions share one deque, so drop an entry only when the new one dominates it).
        while self._peaks and self._peaks[-1][1] <= blocks_held and self._peaks[-1][2] <= seats_held:
            self._peaks.pop()
        self._peaks.append((now, blocks_held, seats_held))

    def _expire(self, now: float) -> None:
        while self._peaks and now - self._peaks[0][0] > self.window_s:
            self._peaks.popleft()

    def observed(self) -> bool:
        self._expire(time.monotonic())
        return bool(self._peaks)

    def current(self, pool_blocks: int, seats: int | None, now: float | None = None) -> Reserve:
        now = time.monotonic() if now is None else now
        self._expire(now)
        cap = math.floor(self.max_fraction * pool_blocks)
        if not self._peaks:
            blocks = math.ceil(self.prior_fraction * pool_blocks)
            want_seats = self.prior_seats
        else:
            blocks = max(b for _, b, _ in self._peaks)
            want_seats = max(s for _, _, s in self._peaks)
        if seats is not None:
            want_seats = min(want_seats, seats - 1)  # the others always keep a seat
        return Reserve(blocks=min(blocks, cap), seats=max(0, want_seats))
