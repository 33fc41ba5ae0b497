"""Fallback for any other model: render its own chat template (as transformers would), then
tokenize the text.

Slower than the dedicated formats and without a chunk cache: spans come from rendering each
prefix of the chat and mapping the text boundaries onto token offsets, which is O(n²) in the
number of messages. Fine for an unknown model; a model we serve often gets its own format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.format import normalize
from proxy.format.base import (
    ChatFormat,
    FormatError,
    Message,
    OutputParser,
    Rendered,
    Span,
    Tool,
    ToolCallIdFactory,
)
from proxy.format.chatml import PlainParser
from proxy.format.template import TemplateError, render_template
from proxy.format.tokenizer import Tokenizer

_SENTINEL_USER = "hyperharness-sentinel-user"
_SENTINEL_REPLY = "hyperharness-sentinel-reply"


def _vllm_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """vLLM's preprocessing that does not depend on the template: developer → system and
    string tool-call arguments → objects."""
    out: list[dict[str, Any]] = []
    for _, m in normalize.developer_to_system(messages):
        msg = dict(m)
        reasoning = normalize.unify_reasoning(m)
        msg.pop("reasoning_content", None)
        msg.pop("reasoning", None)
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if msg.get("tool_calls") is not None:
            calls = []
            for call in normalize.canonical_tool_calls(msg["tool_calls"]):
                calls.append(
                    {"id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["arguments"]}}
                )  # fmt: skip
            if calls:
                msg["tool_calls"] = calls
            else:
                msg.pop("tool_calls")
        if msg.get("content") is None:
            msg["content"] = ""
        elif isinstance(msg["content"], list):
            msg["content"] = normalize.text_of(normalize.content_parts(msg["content"]), "\n")
        out.append(msg)
    return out


class JinjaFormat(ChatFormat):
    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        *,
        name: str = "jinja",
        stop_ids: frozenset[int],
    ) -> None:
        if not stop_ids:
            raise ValueError("JinjaFormat needs at least one stop token id")
        self.name = name
        self.tokenizer = tokenizer
        self.template = template
        self._stop = stop_ids

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop

    def _render_text(self, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> str:
        try:
            return render_template(self.template, messages, tools, **kwargs)
        except TemplateError as exc:
            raise FormatError(str(exc)) from exc

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> Rendered:
        msgs = _vllm_messages(messages)
        canon = normalize.canonical_tools(tools)
        kwargs = {"enable_thinking": enable_thinking, **template_kwargs}
        if continue_final_message:
            raise FormatError("continue_final_message is not supported by the generic Jinja format")
        full = self._render_text(msgs, canon, add_generation_prompt=add_generation_prompt, **kwargs)
        history = self._render_text(msgs, canon, add_generation_prompt=False, **kwargs)
        # Character boundaries: each prefix of the chat must render as a prefix of the whole
        # (not true of templates that rewrite history); otherwise one span covers it all.
        bounds: list[int] = []
        for k in range(1, len(msgs)):
            try:
                prefix = self._render_text(msgs[:k], canon, add_generation_prompt=False, **kwargs)
            except FormatError:
                bounds = []
                break
            if not history.startswith(prefix):
                bounds = []
                break
            bounds.append(len(prefix))
        ids = self.tokenizer.encode(full)
        offsets = _token_starts(self.tokenizer, ids)
        cuts = [_token_at(offsets, b) for b in bounds] + [_token_at(offsets, len(history))]
        spans: tuple[Span, ...]
        if len(cuts) != len(msgs):  # no per-message boundaries: one span for everything
            spans = (Span(0, cuts[-1], None),)
        else:
            starts = [0, *cuts[:-1]]
            spans = tuple(Span(s, e, i) for i, (s, e) in enumerate(zip(starts, cuts, strict=True)))
        gen = Span(cuts[-1], len(ids), None) if add_generation_prompt else None
        return Rendered(ids, spans, gen)

    def render_continuation(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        after_stop: bool = True,
    ) -> list[int]:
        """Render sentinel user + assistant turns followed by `messages`, keep what follows
        the sentinel reply, and drop the stop token's text (the generation already holds it)."""
        canon = normalize.canonical_tools(tools)
        head = [{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_REPLY}]
        text = self._render_text(
            head + _vllm_messages(messages),
            canon,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        at = text.rfind(_SENTINEL_REPLY)
        if at < 0:
            raise FormatError("the chat template dropped the assistant turn; cannot continue it")
        rest = text[at + len(_SENTINEL_REPLY) :]
        if after_stop:
            for stop in sorted(self._stop):
                stop_text = self.tokenizer.token_bytes(stop).decode(errors="replace")
                if rest.startswith(stop_text):
                    rest = rest[len(stop_text) :]
                    break
        return self.tokenizer.encode(rest)

    def parser(
        self,
        *,
        enable_thinking: bool = True,
        tools: Sequence[Tool] | None = None,
        tool_call_id: ToolCallIdFactory | None = None,
        tool_calls: bool = True,
    ) -> OutputParser:
        return PlainParser(self.tokenizer, self.tokenizer.special_ids | self._stop)


def _token_starts(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """Character offset where each token's text starts (byte-exact decoding, then UTF-8 → str
    positions; a token that ends inside a character counts from that character)."""
    starts: list[int] = []
    nbytes = 0
    data = bytearray()
    for tid in ids:
        starts.append(nbytes)
        piece = tokenizer.token_bytes(tid)
        data += piece
        nbytes += len(piece)
    # byte offsets → character offsets
    char_at: dict[int, int] = {}
    chars = 0
    i = 0
    while i < len(data):
        char_at[i] = chars
        b = data[i]
        i += 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
        chars += 1
    char_at[len(data)] = chars
    return [char_at.get(s, char_at[max(k for k in char_at if k <= s)]) for s in starts]


def _token_at(starts: Sequence[int], char: int) -> int:
    """Index of the first token starting at or after `char`."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] < char:
            lo = mid + 1
        else:
            hi = mid
    return lo
