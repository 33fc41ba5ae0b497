"""Prompt ids as JSON text, kept per snapshot so the next turn serializes only its new ids.

`json.dumps` of 100K ids costs ~10 ms (more under load) and would be paid on every turn of a long
session; appending the continuation's few hundred ids to the previous turn's text costs microseconds.
Process-local LRU bounded by characters; a miss (restart, another worker) falls back to a full encode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# ~7 chars per id: 16M chars hold ~2.4M ids, the latest turns of ~20 sessions at 100K tokens (a bound
# that a soak of many short sessions fills within its warm-up, so the RSS it measures stays flat).
DEFAULT_MAX_CHARS = 16 * 1024 * 1024


def _join(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


class IdsText:
    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._chars = 0

    def encode(self, ids: Sequence[int]) -> str:
        return _join(ids)

    def get(self, snapshot_id: str) -> str | None:
        text = self._texts.get(snapshot_id)
        if text is not None:
            self._texts.move_to_end(snapshot_id)
        return text

    def extend(self, snapshot_id: str, ids: Sequence[int], more: Sequence[int]) -> str:
        """Text of `ids + more`, where `ids` are the ids of `snapshot_id`."""
        base = self.get(snapshot_id)
        if base is None:
            base = _join(ids)
        if not more:
            return base
        tail = _join(more)
        return base + "," + tail if base else tail

    def put(self, snapshot_id: str, prompt_text: str, generated: Sequence[int], parent_id: str | None = None) -> None:
        """Remember the text of a new snapshot (prompt + generated); its parent's text is superseded."""
        if parent_id is not None:
            old = self._texts.pop(parent_id, None)
            if old is not None:
                self._chars -= len(old)
        parts = [p for p in (prompt_text, _join(generated)) if p]
        text = ",".join(parts)
        self._texts[snapshot_id] = text
        self._chars += len(text)
        while self._chars > self.max_chars and self._texts:
            _, old = self._texts.popitem(last=False)
            self._chars -= len(old)
