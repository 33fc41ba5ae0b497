"""The format API the serving side programs against: rendered prompts with per-message token
spans, output deltas, and the `ChatFormat` interface every model format implements."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from proxy.format.tokenizer import Tokenizer

Message = Mapping[str, Any]
Tool = Mapping[str, Any]


class FormatError(ValueError):
    """The conversation cannot be rendered (the 4xx class: bad roles, no user query, ...)."""


class Span(NamedTuple):
    """Ids `[start, end)` of the prompt that belong to one message.

    A NamedTuple rather than a dataclass: a 100K-token session has hundreds of spans per
    render, and tuple construction is several times cheaper.

    `message` indexes the caller's message list. It is None for the tools-only system turn (tools
    but no system message) and for the generation prompt. Consecutive tool results share one
    user turn: the first one's span carries the turn opener, the last one's the closer.
    """

    start: int
    end: int
    message: int | None


@dataclass(frozen=True, slots=True)
class Rendered:
    ids: list[int]
    spans: tuple[Span, ...]
    """Contiguous and in order, covering `ids` except the generation prompt."""
    generation: Span | None = None
    """The generation prompt (`<|im_start|>assistant\\n<think>\\n`), when one was added."""

    def span_of(self, message: int) -> Span | None:
        for span in self.spans:
            if span.message == message:
                return span
        return None


def assemble(
    ids_of: Callable[[str], Sequence[int]],
    chunks: Sequence[tuple[int | None, str]],
    generation: str | None,
) -> Rendered:
    """Ids and spans of a prompt from its per-message chunks (message index, text).

    `ids_of` is the formats' chunk cache (`ChunkCache.ids`): chunks end next to special tokens,
    so their ids concatenate to the ids of the whole text. `generation` is the generation
    prompt's text, tokenized last and spanned separately."""
    ids: list[int] = []
    spans: list[Span] = []
    for index, text in chunks:
        start = len(ids)
        ids.extend(ids_of(text))
        spans.append(Span(start, len(ids), index))
    gen = None
    if generation is not None:
        start = len(ids)
        ids.extend(ids_of(generation))
        gen = Span(start, len(ids), None)
    return Rendered(ids, tuple(spans), gen)


class DeltaKind(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"
    """A tool call starts: `index`, `id` and `name` are set."""
    ARGUMENTS = "arguments"
    """A fragment of the tool call's arguments JSON; fragments of one call concatenate."""


@dataclass(frozen=True, slots=True)
class Delta:
    kind: DeltaKind
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text, as OpenAI's `function.arguments`."""


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A whole generation, parsed as vLLM's non-streaming path does."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)


class OutputParser(ABC):
    """Incremental parser of generated ids. One per response; not thread-safe."""

    @abstractmethod
    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        """Consume newly generated ids (stop token included or not) and return what is now
        certain. Ids are authoritative: the parser decodes them itself, so the engine's text
        (and its skip_special_tokens setting) does not matter."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """Flush held-back text and close an unterminated tool call."""

    @abstractmethod
    def result(self) -> ParsedOutput:
        """The whole output so far, with vLLM's non-streaming rules (call after `finish`)."""


ToolCallIdFactory = Callable[[], str]


class ChatFormat(ABC):
    """A model's conversation format: render, continue, parse."""

    name: str
    tokenizer: Tokenizer

    @property
    @abstractmethod
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn (send as `stop_token_ids`)."""

    @abstractmethod
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
        """The prompt ids vLLM would build for this chat request, with per-message spans.

        `messages` and `tools` are OpenAI wire dicts; vLLM's own preprocessing (developer →
        system, reasoning field, string arguments → objects, tool-definition dump) is applied
        here, so the ids equal vLLM `/tokenize` of the same request."""

    @abstractmethod
    def render_continuation(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        after_stop: bool = True,
    ) -> list[int]:
        """Ids to append after an assistant generation so the next prompt is
        `previous prompt + generated ids + continuation`.

        `messages` are only the new messages (tool results, user turns, ...). With
        `after_stop` the generation ended with the stop token (which the engine's output ids
        include); the continuation then starts with the separator the template puts after the
        turn (Qwen/ChatML: "\\n", which the model never generates). Without it the generation
        was cut (length), and the continuation closes the turn first."""

    @abstractmethod
    def parser(
        self,
        *,
        enable_thinking: bool = True,
        tools: Sequence[Tool] | None = None,
        tool_call_id: ToolCallIdFactory | None = None,
        tool_calls: bool = True,
    ) -> OutputParser:
        """A fresh incremental parser for one generation. Without `tool_calls` (`tool_choice:
        "none"`) tool-call markup is not parsed into calls (vLLM suppresses it)."""

    def forced_tool_outputs(
        self, tools: Sequence[Tool], name: str | None, *, parallel: bool = True
    ) -> dict[str, Any] | None:
        """vLLM `structured_outputs` params that make the model call a tool in this format's own
        tool-call syntax: the function `name`, or any of `tools` (`tool_choice: "required"`).
        None when the format has no tool-call syntax; the caller then forces JSON instead."""
        return None
