"""The admission seam: every upstream generation asks `admission.acquire(footprint)` first, tells the
ticket when its prompt is computed (`prefilled`), and releases it when the response ends or the client
leaves. The scheduler (proxy/scheduler) implements it; `NoAdmission` admits everything at once.

These types are the only way callers reach the scheduler: no caller inspects which admission it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Priority(IntEnum):
    """Service classes, served in this order (lower first):

    interactive  the main agent a person is waiting on (the default)
    subagent     a child of another session (a parent id on the wire)
    background   compaction, titles, summaries: nobody watches the tokens arrive
    """

    INTERACTIVE = 0
    SUBAGENT = 1
    BACKGROUND = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | None) -> Priority | None:
        """The class a label names (case and surrounding space ignored), else None."""
        if not value:
            return None
        try:
            return cls[value.strip().upper()]
        except KeyError:
            return None


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a request may come to hold in the engine, known exactly before it is sent."""

    session: str
    prompt_tokens: int  # exact: the proxy rendered the prompt
    max_tokens: int  # already capped to the room left in the context
    reused_tokens: int  # prompt tokens spliced from this session's transcript (likely resident)
    priority: Priority = Priority.INTERACTIVE
    prompt: Sequence[int] = ()  # the ids, so a prefix shared by running requests is counted once


class Ticket(Protocol):
    def prefilled(self) -> None:
        """The engine produced a first token: the prompt's blocks are computed (and shareable)."""
        ...

    def progress(self, generated: int) -> None:
        """The engine has produced `generated` tokens of this request so far."""
        ...

    def release(self) -> None:
        """The request ended (or its client left); idempotent."""
        ...


class Admission(Protocol):
    def try_acquire(self, footprint: Footprint) -> Ticket | None:
        """The ticket at once if the request may start now (nothing waits ahead of it, room now);
        None: `acquire` decides. Never waits, never refuses. The check before the change: a turn
        admitted here is opened inline, with no task holding its client through a wait."""
        ...

    async def acquire(self, footprint: Footprint) -> Ticket:
        """Wait until the request may start; raise a ProxyError (429/503) to refuse it."""
        ...


class OpenTicket:
    """A ticket that holds nothing (no admission, or admission switched off)."""

    def prefilled(self) -> None:
        return None

    def progress(self, generated: int) -> None:
        return None

    def release(self) -> None:
        return None


class NoAdmission:
    def try_acquire(self, footprint: Footprint) -> Ticket | None:
        return OpenTicket()

    async def acquire(self, footprint: Footprint) -> Ticket:
        return OpenTicket()
