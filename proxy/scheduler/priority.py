"""Priority classes, served in this order:

    interactive  the main agent a person is waiting on (the default)
    subagent     a child of another session (a parent id on the wire)
    background   compaction, titles, summaries: nobody watches the tokens arrive

The detection of harness signals lives in proxy/quirks.py (`priority_class`), which the chat route runs
first and which writes its verdict into the `x-hyperharness-priority` header the pipeline sees; a
client may set that header itself. `infer_priority` reads the header, else asks quirks directly (for
callers that skipped `prepare_chat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Any

from proxy import quirks

PRIORITY_HEADER = quirks.PRIORITY_HEADER


class Priority(IntEnum):
    """Lower value is served first."""

    INTERACTIVE = 0
    SUBAGENT = 1
    BACKGROUND = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | None) -> Priority | None:
        if not value:
            return None
        try:
            return cls[value.strip().upper()]
        except KeyError:
            return None


def infer_priority(headers: Mapping[str, str], body: Mapping[str, Any]) -> Priority:
    """`headers` must be case-insensitive (Starlette's are) or lower-cased."""
    explicit = Priority.parse(headers.get(PRIORITY_HEADER))
    if explicit is not None:
        return explicit
    parent = quirks.session_ids(headers, body).parent
    return Priority.parse(quirks.priority_class(headers, body, parent)) or Priority.INTERACTIVE
