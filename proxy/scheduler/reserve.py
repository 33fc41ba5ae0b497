"""The room kept for interactive requests (the main agent), sized from what they were seen to need.

A fixed share of the pool either starves the subagents (a main agent that sends 2K-token turns does not
need a tenth of a 100K pool) or fails the main agent (one that sends 40K-token turns needs more). So the
reserve is sized from the interactive requests of the last `window_s`:
- blocks: a high quantile (`QUANTILE`) of what one of them needed beyond the prompt prefix the engine
  already caches (a main agent's turn re-sends its conversation, which its running subagents hold as
  their shared parent), times the most of them seen running at once;
- seats: the most of them seen running at once.
A quantile, not the maximum: the first turn of a conversation (nothing cached yet) or one pasted file
would otherwise hold a large share of the pool for the whole window; such a turn, when the pool is
full, waits for room (it is first in line) rather than preempting anything.
Before any interactive request is seen, and after the window passes with none, the configured prior
(`reserve_fraction`, `reserve_seats`) stands in. Bounded by `reserve_max_fraction` of the pool.

The reserve is headroom *beyond* what interactive requests hold now: while the main agent runs, its
blocks are already counted as used, so the others are kept out only of `reserve - held`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

QUANTILE = 0.75
_SAMPLES = 64  # most recent interactive requests considered


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
        self._seen: deque[tuple[float, int, int]] = deque(maxlen=_SAMPLES)  # (when, blocks needed, running)
        self._memo: tuple[int, int | None, Reserve] | None = None  # (pool_blocks, seats, what they gave)

    def observe(self, blocks: int, running: int, now: float | None = None) -> None:
        """An interactive request was admitted needing `blocks` beyond the cached prefix, with `running`
        interactive requests (itself included) running."""
        now = time.monotonic() if now is None else now
        self._seen.append((now, blocks, running))
        self._memo = None

    def _expire(self, now: float) -> None:
        while self._seen and now - self._seen[0][0] > self.window_s:
            self._seen.popleft()
            self._memo = None

    def current(self, pool_blocks: int, seats: int | None, now: float | None = None) -> Reserve:
        """The reserve now. Asked on every admission decision, so it is kept until a sample comes or
        goes (sorting 64 samples per ask was most of the scheduler's cost per request)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        memo = self._memo
        if memo is not None and memo[0] == pool_blocks and memo[1] == seats:
            return memo[2]
        if not self._seen:
            blocks = math.ceil(self.prior_fraction * pool_blocks)
            want_seats = self.prior_seats
        else:
            need = sorted(b for _, b, _ in self._seen)
            want_seats = max(r for _, _, r in self._seen)
            blocks = need[min(len(need) - 1, math.ceil(QUANTILE * len(need)) - 1)] * want_seats
        if seats is not None:
            want_seats = min(want_seats, seats - 1)  # the others always keep a seat
        r = Reserve(blocks=min(blocks, math.floor(self.max_fraction * pool_blocks)), seats=max(0, want_seats))
        self._memo = (pool_blocks, seats, r)
        return r
