"""Token-exact session transcripts: what was sent and generated, and how the next request extends it.

A `Snapshot` is one finished response: the exact prompt ids plus the generated ids, the keys of the
messages the prompt covered, and the key of the reply. When a request arrives, `match()` looks for a
snapshot whose messages are the request's first messages and whose reply is the next message; then the
new prompt is `snapshot.ids + render_continuation(rest)` and starts, token for token, with what the
engine already has (the append-only invariant). Anything else is a divergence with a reason.

Message keys are tolerant where harnesses are sloppy and strict where content changed:
- assistant reasoning is ignored (Hermes strips it, Pi renames it; we splice the ids we generated),
- tool-call arguments compare as canonical JSON (clients re-serialize them),
- content compares with surrounding whitespace stripped and text parts joined.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_text(content: Any) -> str:
    """Text of a message content (string or list of parts); non-text parts by canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text") or ""))
        else:
            parts.append(_canon(part))
    return "".join(parts).strip()


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments


def _canonical_arguments(arguments: Any) -> str:
    return _canon(_args(arguments))


def message_key(message: dict[str, Any]) -> str:
    """Identity of a message for matching; see the module docstring for what is tolerated.

    Hashes the text directly (no JSON of the whole message): every request keys every message, and
    a 100K-token history is ~400 KB of text, so this must run at hashing speed."""
    role = message.get("role")
    if role == "developer":
        role = "system"
    h = hashlib.blake2b(digest_size=12)
    h.update(str(role).encode())
    h.update(b"\x00")
    h.update(content_text(message.get("content")).encode())
    if role == "assistant":
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            h.update(
                b"\x01" + str(fn.get("name")).encode() + b"\x00" + _canonical_arguments(fn.get("arguments")).encode()
            )
    elif role == "tool":
        h.update(b"\x02" + str(message.get("tool_call_id") or "").encode())
    if message.get("name"):
        h.update(b"\x03" + str(message["name"]).encode())
    return h.hexdigest()


class MessageKeys:
    """`message_key` with an LRU in front, keyed by the message's raw fields.

    Every request keys its whole history; with the cache, an unchanged message costs one tuple hash
    and one equality check of its strings (C speed) instead of UTF-8 encoding, hashing and
    re-serializing its tool arguments. Only string content and string arguments are cached (what
    harnesses send); anything else is keyed directly.
    """

    def __init__(self, max_entries: int = 8192, max_chars: int = 16 * 1024 * 1024) -> None:
        # Bounded by the characters its keys hold too: the keys are the messages' own strings, and
        # 65,536 tool results of 50 KB would otherwise keep 3 GB alive. 8,192 messages are the
        # histories of 20-40 long sessions; a miss costs one `message_key`.
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._cache: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self._chars = 0

    def __call__(self, message: dict[str, Any]) -> str:
        return self.keys((message,))[0]

    def keys(self, messages: Sequence[dict[str, Any]]) -> list[str]:
        # Hot loop (every message of every request): locals only, no LRU reordering on hits, so the
        # cache is FIFO-bounded; a re-keyed message costs one `message_key`.
        cache = self._cache
        out: list[str] = []
        for m in messages:
            content = m.get("content")
            if (content is None or type(content) is str) and not m.get("tool_calls"):
                raw: tuple[Any, ...] | None = (m.get("role"), content, m.get("tool_call_id"), m.get("name"))
            else:
                raw = _raw_fields(m)
            if raw is None:
                out.append(message_key(m))
                continue
            key = cache.get(raw)
            if key is None:
                key = cache[raw] = message_key(m)
                self._chars += _raw_chars(raw)
                while len(cache) > self.max_entries or self._chars > self.max_chars:
                    self._chars -= _raw_chars(cache.popitem(last=False)[0])
            out.append(key)
        return out


def _raw_chars(raw: tuple[Any, ...]) -> int:
    """The characters of a cache key's strings (content, and tool-call arguments when present)."""
    n = len(raw[1] or "")
    if len(raw) == 5:
        n += sum(len(args or "") for _, args in raw[4])
    return n


def _raw_fields(message: dict[str, Any]) -> tuple[Any, ...] | None:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return None
    calls: tuple[Any, ...] = ()
    if message.get("tool_calls"):
        out = []
        for call in message["tool_calls"]:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if args is not None and not isinstance(args, str):
                return None
            out.append((fn.get("name"), args))
        calls = tuple(out)
    return (message.get("role"), content, message.get("tool_call_id"), message.get("name"), calls)


def context_key(tools_key: str, template_kwargs: dict[str, Any]) -> str:
    return hashlib.blake2b((tools_key + "\x00" + _canon(template_kwargs)).encode(), digest_size=12).hexdigest()


def new_snapshot_id() -> str:
    # Time first, so sorting ids orders snapshots by age (the stores evict the oldest).
    return f"{time.time_ns():016x}{os.urandom(4).hex()}"


@dataclass(slots=True)
class Snapshot:
    ids: array[int]  # array('I'): prompt ids then generated ids, exactly as the engine saw/produced them
    prompt_len: int
    msg_keys: list[str]  # keys of the request messages the prompt covered
    msg_ends: list[int]  # token offset (in ids) where each covered message's span ends; may be empty
    reply_key: str  # message_key of the generated assistant message
    context: str  # context_key: tools + template kwargs
    finish_reason: str
    snapshot_id: str = field(default_factory=new_snapshot_id)
    parent_id: str | None = None

    def to_bytes(self) -> bytes:
        header = {
            "p": self.prompt_len,
            "k": self.msg_keys,
            "e": self.msg_ends,
            "r": self.reply_key,
            "c": self.context,
            "f": self.finish_reason,
            "i": self.snapshot_id,
            "pa": self.parent_id,
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        ids = self.ids if self.ids.itemsize == 4 else array("I", self.ids)
        return len(head).to_bytes(4, "little") + head + ids.tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Snapshot:
        n = int.from_bytes(blob[:4], "little")
        h = json.loads(blob[4 : 4 + n])
        ids = array("I")
        ids.frombytes(blob[4 + n :])
        return cls(
            ids=ids,
            prompt_len=h["p"],
            msg_keys=h["k"],
            msg_ends=h["e"],
            reply_key=h["r"],
            context=h["c"],
            finish_reason=h["f"],
            snapshot_id=h["i"],
            parent_id=h.get("pa"),
        )


@dataclass(frozen=True, slots=True)
class Match:
    """Outcome of matching a request against a session's snapshots.

    `snapshot` set and `reason` None: splice; render only `messages[new_from:]` after `snapshot.ids`.
    `reason` set: divergence (fresh render); `snapshot` is the closest one, for accounting, and
    `shared_tokens` the length of its ids covered by messages the request still carries unchanged.
    """

    snapshot: Snapshot | None
    new_from: int = 0
    reason: str | None = None
    shared_tokens: int = 0


def _shared_prefix(snapshot: Snapshot, keys: list[str]) -> tuple[int, int]:
    """(number of leading request messages equal to the snapshot's, tokens they cover in its ids)."""
    n = 0
    for a, b in zip(snapshot.msg_keys, keys, strict=False):
        if a != b:
            break
        n += 1
    if n == len(snapshot.msg_keys) and len(keys) > n and keys[n] == snapshot.reply_key:
        return n + 1, len(snapshot.ids)
    tokens = snapshot.msg_ends[n - 1] if n and len(snapshot.msg_ends) >= n else 0
    return n, tokens


def match(
    snapshots: Sequence[Snapshot], messages: list[dict[str, Any]], context: str, keys: list[str] | None = None
) -> Match:
    """Find the snapshot this request extends (newest first); else the best divergence reason.
    `keys` are the messages' `message_key`s when the caller has them already."""
    if not snapshots:
        return Match(snapshot=None, reason=None)
    if keys is None:
        keys = [message_key(m) for m in messages]
    best: Match | None = None
    for snap in snapshots:
        k = len(snap.msg_keys)
        n, shared = _shared_prefix(snap, keys)
        if snap.context != context:
            reason = "tools_or_options_changed"
        elif n == k + 1 and len(keys) > k + 1:
            return Match(snapshot=snap, new_from=k + 1)
        elif n == k + 1:
            reason = "no_new_messages"  # the request ends with our reply (a prefill) or repeats it
        elif n == k and len(keys) > k:
            reason = "reply_changed" if messages[k].get("role") == "assistant" else "reply_missing"
        elif len(keys) <= n:
            reason = "history_truncated"  # a compaction or a retry of an earlier turn
        else:
            reason = "history_edited"
        if best is None or shared > best.shared_tokens:
            best = Match(snapshot=snap, reason=reason, shared_tokens=shared)
    return best if best is not None else Match(snapshot=None)


def _as_bytes(ids: Sequence[int]) -> bytes:
    arr = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    return arr.tobytes()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common token prefix. Compares 8 KB byte slices (memcmp) and walks ids only inside
    the first differing slice, so long transcripts stay cheap; used for divergence accounting."""
    ab, bb = _as_bytes(a), _as_bytes(b)
    n = min(len(ab), len(bb))
    step = 8192
    i = 0
    while i < n:
        j = min(i + step, n)
        if ab[i:j] != bb[i:j]:
            for k in range(i, j):
                if ab[k] != bb[k]:
                    return k // 4
        i = j
    return n // 4
