"""Chunk text → ids, cached, so a growing session tokenizes only its new messages.

The formats split a prompt into per-message chunks whose boundaries sit next to special tokens
(`<|im_end|>\\n<|im_start|>`), where BPE cannot merge across, so encoding chunk by chunk gives
exactly the ids of encoding the whole prompt. Keying on the chunk's full text (not on message
identity) makes a hit correct by construction; the cost of a hit is one string hash (~0.3 ms
for a 100K-token history) and a list extend.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable


class ChunkCache:
    """LRU map from chunk text to its ids, bounded by the total number of cached ids.

    Ids are kept as `array('I')`, 4 bytes an id, where a list holds a pointer and an int object (~40):
    4M cached ids are 16 MB rather than 160 MB, and the map no longer looks like a leak while it fills
    (the soak saw the proxy grow ~300 bytes per request for minutes). Returned arrays are shared:
    callers copy them (`list.extend`) and never mutate them.
    Thread-safe: a large render runs in a worker thread (proxy/plan.py) beside the loop's small ones;
    the lock is held for the map only, never while encoding.
    """

    # Short chunks are cached too: a fast tokenizer's encode call costs 20-50 µs however short the
    # text (the generation prompt, a one-line user turn), a hit ~0.2 µs. The entry bound is what the
    # sessions worth keeping hold (8,192 messages: 20-40 long agent histories, more than the store's
    # 256 transcripts draw on); at 200,000 a stream of new sessions grew the proxy ~700 bytes a session
    # for hours before the bound was reached (the soak's 19,000 sessions in 10 minutes: +13 MB).
    MAX_ENTRIES = 8192

    def __init__(self, encode: Callable[[str], list[int]], max_tokens: int = 4_000_000) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self._encode = encode
        self._max_tokens = max_tokens
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def ids(self, text: str) -> array[int]:
        entries = self._entries
        with self._lock:
            found = entries.get(text)
            if found is not None:
                entries.move_to_end(text)
                self.hits += 1
                return found
            self.misses += 1
        ids = array("I", self._encode(text))
        if len(ids) > self._max_tokens:
            return ids
        with self._lock:
            if text in entries:  # encoded meanwhile by the other thread
                return entries[text]
            entries[text] = ids
            self._tokens += len(ids)
            while self._tokens > self._max_tokens or len(entries) > self.MAX_ENTRIES:
                _, old = entries.popitem(last=False)
                self._tokens -= len(old)
        return ids

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
