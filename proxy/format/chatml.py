"""Plain ChatML (SmolLM2): `<|im_start|>role\\ncontent<|im_end|>\\n`, no tools, no reasoning.

vLLM detects the "string" content format for such templates, so list content reaches the
template as its text parts joined with "\\n", and assistant tool calls are not rendered. Some
templates open with a default system turn when the chat has none (SmolLM2: "You are a helpful
AI assistant named SmolLM, trained by Hugging Face"); `from_template` reads it off the model's
own template and then checks itself against that template, so a model whose template is not
plain ChatML is refused here (the loader then uses JinjaFormat).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.format import normalize
from proxy.format.base import (
    ChatFormat,
    Delta,
    DeltaKind,
    FormatError,
    Message,
    OutputParser,
    ParsedOutput,
    Rendered,
    Tool,
    ToolCallIdFactory,
    assemble,
)
from proxy.format.cache import ChunkCache
from proxy.format.template import TemplateError, render_template
from proxy.format.tokenizer import IncrementalDecoder, Tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_PROBE = "hyperharness-probe"


class PlainParser(OutputParser):
    """All output is content: no reasoning or tool parser configured (vLLM's default), and
    special tokens skipped from the text as `skip_special_tokens=True` does."""

    def __init__(self, tokenizer: Tokenizer, skip_ids: frozenset[int]) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._skip = skip_ids
        self._parts: list[str] = []

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        if len(token_ids) == 1:  # one token per read, the usual case: no list built
            text = self._decoder.feed(() if token_ids[0] in self._skip else token_ids)
        else:
            text = self._decoder.feed([t for t in token_ids if t not in self._skip])
        return self._emit(text)

    def finish(self) -> list[Delta]:
        return self._emit(self._decoder.flush())

    def _emit(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._parts.append(text)
        return [Delta(DeltaKind.CONTENT, text)]

    def result(self) -> ParsedOutput:
        return ParsedOutput("".join(self._parts) or None, None)


def string_content(message: Message) -> str:
    """Content as vLLM's "string" format gives it: text parts joined with "\\n"."""
    parts = normalize.content_parts(message.get("content"))
    if message.get("role") == "system":
        parts = normalize.strip_billing_header(parts)
    return normalize.text_of(parts, "\n")


class ChatMLFormat(ChatFormat):
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        default_system: str | None = None,
        name: str = "chatml",
        stop_ids: frozenset[int] | None = None,
        cache_tokens: int = 4_000_000,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.cache = ChunkCache(tokenizer.encode, cache_tokens)
        self._stop = stop_ids or frozenset((tokenizer.token_id(IM_END),))
        tokenizer.token_id(IM_START)

    @classmethod
    def from_template(cls, tokenizer: Tokenizer, template: str, **kwargs: Any) -> ChatMLFormat:
        """Read the default system turn off `template` and verify the result renders like it."""
        try:
            probe = render_template(template, [{"role": "user", "content": _PROBE}])
        except TemplateError as exc:
            raise FormatError(f"template is not plain ChatML: {exc}") from exc
        user_turn = f"{IM_START}user\n{_PROBE}{IM_END}\n"
        if not probe.endswith(user_turn):
            raise FormatError("template is not plain ChatML (user turn differs)")
        head = probe[: -len(user_turn)]
        default_system = None
        if head:
            prefix, suffix = f"{IM_START}system\n", f"{IM_END}\n"
            if not (head.startswith(prefix) and head.endswith(suffix)):
                raise FormatError("template is not plain ChatML (default system turn differs)")
            default_system = head[len(prefix) : -len(suffix)]
        fmt = cls(tokenizer, default_system=default_system, **kwargs)
        fmt.check_against(template)
        return fmt

    def check_against(self, template: str) -> None:
        """Raise FormatError unless this format renders probe chats exactly like `template`."""
        probes: list[list[dict[str, Any]]] = [
            [{"role": "user", "content": "a"}],
            [{"role": "system", "content": " s "}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "r\n"}, {"role": "user", "content": "n"}],
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"},
             {"role": "tool", "content": "t"}],
        ]  # fmt: skip
        for messages in probes:
            for gen in (False, True):
                ours = self._text(messages, add_generation_prompt=gen)
                theirs = render_template(template, messages, add_generation_prompt=gen)
                if ours != theirs:
                    raise FormatError(f"template is not plain ChatML: {theirs!r} != {ours!r}")

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop

    def _chunks(self, messages: Sequence[Message]) -> list[tuple[int | None, str]]:
        pairs = normalize.developer_to_system(messages)
        chunks: list[tuple[int | None, str]] = []
        if self.default_system is not None and (not pairs or pairs[0][1].get("role") != "system"):
            chunks.append((None, f"{IM_START}system\n{self.default_system}{IM_END}\n"))
        for index, m in pairs:
            role = m.get("role")
            if not isinstance(role, str):
                raise FormatError(f"message {index}: role must be a string")
            chunks.append((index, f"{IM_START}{role}\n{string_content(m)}{IM_END}\n"))
        return chunks

    def _text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        text = "".join(c for _, c in self._chunks(messages))
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")

    def _assemble(self, chunks: Sequence[tuple[int | None, str]], generation: str | None) -> Rendered:
        return assemble(self.cache.ids, chunks, generation)

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
        normalize.canonical_tools(tools)  # validated like vLLM does, but not rendered
        if not messages:
            raise FormatError("No messages provided.")
        chunks = self._chunks(messages)
        if continue_final_message:
            if add_generation_prompt or messages[-1].get("role") != "assistant":
                raise FormatError("continue_final_message needs a final assistant message and no generation prompt")
            index, text = chunks[-1]
            # transformers cuts right after the final content; ChatML does not trim it.
            chunks[-1] = (index, text[: -len(IM_END + "\n")])
        return self._assemble(chunks, f"{IM_START}assistant\n" if add_generation_prompt else None)

    def render_continuation(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        after_stop: bool = True,
    ) -> list[int]:
        del tools
        body = [(i, f"{IM_START}{m.get('role')}\n{string_content(m)}{IM_END}\n") for i, m in enumerate(messages)]
        chunks: list[tuple[int | None, str]] = [(None, "\n" if after_stop else IM_END + "\n"), *body]
        return self._assemble(chunks, f"{IM_START}assistant\n" if add_generation_prompt else None).ids

    def parser(
        self,
        *,
        enable_thinking: bool = True,
        tools: Sequence[Tool] | None = None,
        tool_call_id: ToolCallIdFactory | None = None,
        tool_calls: bool = True,
    ) -> OutputParser:
        return PlainParser(self.tokenizer, self.tokenizer.special_ids | self._stop)
