"""vLLM completions logprobs → OpenAI chat logprobs.

We ask /v1/completions for `return_tokens_as_token_ids`, so each streamed event carries
`logprobs: {tokens: ["token_id:N", ...], token_logprobs: [...], top_logprobs: [{"token_id:M": lp}]}`:
ids, not decoded strings, so top alternatives never collide. `token` is the id decoded alone, as
vLLM's chat endpoint shows it; `bytes` are the token's own bytes (a token that ends inside a UTF-8
character keeps its partial bytes), so the entries' bytes concatenate to the output's bytes.
vLLM's completions `top_logprobs` hold up to the requested count + 1 (the sampled token first); its
chat endpoint reports the first `top` of them, and so do we.

Only built when the client asked for logprobs; nothing here runs otherwise.
"""

from __future__ import annotations

from typing import Any

from proxy.format.tokenizer import Tokenizer

_PREFIX = "token_id:"
_FLOOR = -9999.0  # vLLM clamps -inf to this (JSON has no infinity)


class LogprobsBuilder:
    """Chat `logprobs.content` entries, one per generated token, in order."""

    def __init__(self, tokenizer: Tokenizer, top: int) -> None:
        self._tok = tokenizer
        self._top = top
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self.entries: list[dict[str, Any]] = []
        self.sent = 0  # entries already streamed

    def _token(self, key: str | int) -> tuple[str, list[int]]:
        tid = key if isinstance(key, int) else int(key[len(_PREFIX) :]) if key.startswith(_PREFIX) else None
        if tid is None:  # an engine that did not honour return_tokens_as_token_ids: the text itself
            return str(key), list(str(key).encode("utf-8", errors="replace"))
        hit = self._cache.get(tid)
        if hit is None:
            # The text as vLLM's chat endpoint shows it (the id decoded alone); the bytes are the
            # token's own, so the bytes of all entries concatenate to the output's bytes.
            hit = self._cache[tid] = (self._tok.decode([tid]), list(self._tok.token_bytes(tid)))
        return hit

    def add(self, logprobs: Any, token_ids: list[int]) -> None:
        """One event's completions logprobs (or None, which an engine sends for no tokens)."""
        if not logprobs:
            return
        tokens = logprobs.get("tokens") or ()
        values = logprobs.get("token_logprobs") or ()
        tops = logprobs.get("top_logprobs") or ()
        for i, key in enumerate(tokens):
            token, raw = self._token(key if key is not None else token_ids[i])
            value = values[i] if i < len(values) else None
            alts = []
            top = tops[i] if i < len(tops) else None
            if top and self._top:
                for n, (alt_key, alt_value) in enumerate(top.items()):
                    if n >= self._top:
                        break
                    alt, alt_raw = self._token(alt_key)
                    alts.append({"token": alt, "logprob": max(alt_value, _FLOOR), "bytes": alt_raw})
            self.entries.append(
                {"token": token, "logprob": _FLOOR if value is None else max(value, _FLOOR), "bytes": raw,
                 "top_logprobs": alts}
            )

    def take(self) -> list[dict[str, Any]]:
        """Entries not streamed yet (marked as sent)."""
        out = self.entries[self.sent :]
        self.sent = len(self.entries)
        return out

    def body(self) -> dict[str, Any]:
        return {"content": self.entries}
