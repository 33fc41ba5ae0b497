"""The seam where issue 4's scheduler sits: every upstream generation asks `admission.acquire(footprint)`
first and releases the returned ticket when the response ends (or the client leaves).

`NoAdmission` admits everything at once; the scheduler will implement the same two calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Footprint:
    session: str
    prompt_tokens: int  # exact: the proxy rendered the prompt
    max_tokens: int  # already capped to the room left in the context
    reused_tokens: int  # prompt tokens spliced from this session's transcript (likely resident)
    priority: str = "interactive"  # interactive | subagent | background (issue 4 infers it)


class Ticket(Protocol):
    def release(self) -> None: ...


class Admission(Protocol):
    async def acquire(self, footprint: Footprint) -> Ticket:
        """Wait until the request may start; raise a ProxyError (429/503) to refuse it."""
        ...


class _NullTicket:
    def release(self) -> None:
        return None


class NoAdmission:
    async def acquire(self, footprint: Footprint) -> Ticket:
        return _NullTicket()
