"""Admission by KV pool geometry (issue 4): no preemption, priority classes, fair queueing.

    pool.py       engine geometry from /metrics (vllm:cache_config_info) and live gauges
    footprint.py  a request's worst case in blocks; shared prompt prefixes counted once
    priority.py   interactive > subagent > background, inferred from harness signals
    queue.py      the waiting room: class order, fairness across sessions
    scheduler.py  Scheduler: the Admission seam's implementation, limits, metrics
    hold.py       holding a queued client: disconnect = leave the queue, SSE keep-alives
No FastAPI here: the app calls `hold()` and `open_scheduler()`.
"""

from .errors import QueueFull, QueueTimeout, Refused
from .footprint import PromptFootprint, worst_case_blocks
from .hold import ClientGone, Queued, hold
from .pool import LiveGauges, PoolGeometry, read_metrics
from .priority import PRIORITY_HEADER, Priority, infer_priority
from .scheduler import Scheduler, SchedulerConfig, SeatTicket, open_scheduler

__all__ = [
    "PRIORITY_HEADER", "ClientGone", "LiveGauges", "PoolGeometry", "Priority", "PromptFootprint", "QueueFull",
    "QueueTimeout", "Queued", "Refused", "Scheduler", "SchedulerConfig", "SeatTicket", "hold", "infer_priority",
    "open_scheduler", "read_metrics", "worst_case_blocks",
]
