"""The embedded store: an LRU of sessions bounded by count and by total ids, with TTL expiry and an
optional file written atomically on close (and read on start), so a restart keeps warm transcripts."""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from proxy.transcripts import Snapshot

log = logging.getLogger("proxy.store")

# 32M ids is 128 MB of packed transcripts: a few hundred long agent sessions.
DEFAULT_MAX_IDS = 32 * 1024 * 1024
_MAGIC = b"HHTS1\n"


class MemoryStore:
    def __init__(
        self,
        *,
        max_sessions: int = 256,
        ttl_s: float = 6 * 3600,
        per_session: int = 4,
        max_ids: int = DEFAULT_MAX_IDS,
        path: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1 or per_session < 1 or ttl_s <= 0:
            raise ValueError(f"bad store bounds: max_sessions={max_sessions} per_session={per_session} ttl_s={ttl_s}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.per_session = per_session
        self.max_ids = max_ids
        self.path = Path(path) if path else None
        self._clock = clock
        # session -> (expires_at, snapshots newest first); move_to_end on use = LRU order
        self._data: OrderedDict[str, tuple[float, list[Snapshot]]] = OrderedDict()
        self._ids = 0
        if self.path and self.path.exists():
            self._read_file(self.path)

    async def load(self, session: str) -> list[Snapshot]:
        entry = self._data.get(session)
        if entry is None:
            return []
        expires, snaps = entry
        now = self._clock()
        if expires <= now:
            self._drop(session)
            return []
        self._data[session] = (now + self.ttl_s, snaps)
        self._data.move_to_end(session)
        return list(snaps)

    async def save(self, session: str, snapshot: Snapshot) -> None:
        old = self._data.pop(session, (0.0, []))[1]
        self._ids -= sum(len(s.ids) for s in old)
        snaps = [snapshot] + [s for s in old if s.snapshot_id != snapshot.parent_id]
        snaps = snaps[: self.per_session]
        self._ids += sum(len(s.ids) for s in snaps)
        self._data[session] = (self._clock() + self.ttl_s, snaps)
        self._evict()

    async def delete(self, session: str) -> None:
        self._drop(session)

    async def count(self) -> int:
        return len(self._data)

    async def close(self) -> None:
        if self.path:
            self._write_file(self.path)

    def _drop(self, session: str) -> None:
        entry = self._data.pop(session, None)
        if entry is not None:
            self._ids -= sum(len(s.ids) for s in entry[1])

    def _evict(self) -> None:
        # Every use sets expiry to now + ttl and moves the session to the end, so LRU order is expiry
        # order: the expired ones are at the head (a scan of every session per save was O(sessions)).
        now = self._clock()
        while self._data and next(iter(self._data.values()))[0] <= now:
            self._drop(next(iter(self._data)))
        while self._data and (len(self._data) > self.max_sessions or self._ids > self.max_ids):
            self._drop(next(iter(self._data)))

    def _write_file(self, path: Path) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        now = self._clock()
        with open(tmp, "wb") as f:
            f.write(_MAGIC)
            for session, (expires, snaps) in self._data.items():
                name = session.encode()
                f.write(struct.pack("<IdI", len(name), expires - now, len(snaps)) + name)
                for snap in snaps:
                    blob = snap.to_bytes()
                    f.write(struct.pack("<Q", len(blob)) + blob)
        os.replace(tmp, path)

    def _read_file(self, path: Path) -> None:
        data = path.read_bytes()
        if not data.startswith(_MAGIC):
            log.warning("ignoring transcript file %s: not a transcript store", path)
            return
        pos, now = len(_MAGIC), self._clock()
        try:
            while pos < len(data):
                n, left, count = struct.unpack_from("<IdI", data, pos)
                pos += 16
                session = data[pos : pos + n].decode()
                pos += n
                snaps = []
                for _ in range(count):
                    (size,) = struct.unpack_from("<Q", data, pos)
                    snaps.append(Snapshot.from_bytes(data[pos + 8 : pos + 8 + size]))
                    pos += 8 + size
                if left > 0:
                    self._data[session] = (now + left, snaps)
                    self._ids += sum(len(s.ids) for s in snaps)
        except (struct.error, ValueError, KeyError) as exc:
            log.warning("transcript file %s is damaged after %d sessions: %s", path, len(self._data), exc)
        self._evict()
