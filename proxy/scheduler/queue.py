"""The waiting room: strict order across priority classes, fair across sessions within a class.

Fairness: within a class the next request comes from the session with the fewest requests running,
then the one served least recently, then the longest-waiting head; inside one session, FIFO. So two
sessions that each fan out four subagents alternate instead of the first one's burst going first.
Owns only waiting requests and the per-session last-served clock; running counts are passed in.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.admission import Priority

_LAST_SERVED_CAP = 4096  # sessions remembered for tie-breaking; older ones count as never served


@dataclass(eq=False, slots=True)
class Waiter:
    session: str
    priority: Priority
    blocks: int  # worst case, with no shared prefix
    hashes: Sequence[bytes]  # shareable prompt blocks
    enqueued: float
    future: asyncio.Future[Any] = field(repr=False)
    seq: int = 0
    out_tokens: int = 0  # the most it may generate (max_tokens)


class AdmissionQueue:
    def __init__(self) -> None:
        self._lanes: list[dict[str, deque[Waiter]]] = [{} for _ in Priority]
        self._last_served: OrderedDict[str, int] = OrderedDict()
        self._clock = itertools.count(1)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def depth(self, priority: Priority) -> int:
        return sum(len(lane) for lane in self._lanes[priority].values())

    def push(self, w: Waiter) -> None:
        w.seq = next(self._clock)
        self._lanes[w.priority].setdefault(w.session, deque()).append(w)
        self._size += 1

    def remove(self, w: Waiter) -> bool:
        lanes = self._lanes[w.priority]
        lane = lanes.get(w.session)
        if lane is None or w not in lane:
            return False
        lane.remove(w)
        if not lane:
            del lanes[w.session]
        self._size -= 1
        return True

    def served(self, w: Waiter) -> None:
        """Take `w` out as admitted and stamp its session as just served."""
        if self.remove(w):
            self.stamp_served(w.session)

    def stamp_served(self, session: str) -> None:
        """`session` was just served (also when its request was admitted without waiting here)."""
        self._last_served[session] = next(self._clock)
        self._last_served.move_to_end(session)
        while len(self._last_served) > _LAST_SERVED_CAP:
            self._last_served.popitem(last=False)

    def in_order(self, running: Mapping[str, int]) -> Iterator[Waiter]:
        """Every waiter in service order; the first is the head of the queue."""
        for lanes in self._lanes:
            if not lanes:
                continue
            order = sorted(lanes.items(), key=lambda kv: (running.get(kv[0], 0), self._last_served.get(kv[0], 0),
                                                          kv[1][0].seq))
            # Round robin over the sorted lanes, one request per session per round.
            queues = [list(lane) for _, lane in order]
            for depth in range(max(len(q) for q in queues)):
                for q in queues:
                    if depth < len(q):
                        yield q[depth]

    def head(self, running: Mapping[str, int]) -> Waiter | None:
        return next(self.in_order(running), None)
