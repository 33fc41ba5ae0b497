"""Admission by KV pool geometry: no preemption, priority classes, fair queueing.

    pool.py       the engine's pool from /metrics (vllm:cache_config_info), per-seat costs from the runtime
                  config, live gauges
    footprint.py  a request's worst case in blocks; shared prompt prefixes counted once
    queue.py      the waiting room: class order, fairness across sessions
    scheduler.py  Scheduler: the Admission seam's implementation, limits, metrics
    hold.py       holding a queued client: disconnect = leave the queue, SSE keep-alives
No FastAPI here: the app calls `hold()` and `open_scheduler()`. Priority classes are proxy/admission.py's.
"""

from .errors import QueueFull, QueueTimeout, Refused
from .footprint import worst_case_blocks
from .hold import ClientGone, Queued, hold
from .pool import LiveGauges, PoolGeometry, read_metrics
from .scheduler import Scheduler, SeatTicket, open_scheduler

__all__ = [
    "ClientGone", "LiveGauges", "PoolGeometry", "QueueFull", "QueueTimeout", "Queued", "Refused", "Scheduler",
    "SeatTicket", "hold", "open_scheduler", "read_metrics", "worst_case_blocks",
]
