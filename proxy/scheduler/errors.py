"""Refusals with Retry-After: 429 when the queue is full, 503 when a request waited too long."""

from __future__ import annotations

from proxy.errors import ProxyError


class Refused(ProxyError):
    """A ProxyError that carries response headers (the app sends `exc.headers` when present)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = {"retry-after": str(retry_after_s)}


class QueueFull(Refused):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class QueueTimeout(Refused):
    status = 503
    type = "server_error"
    code = "queue_timeout"
