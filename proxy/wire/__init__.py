"""Wire formats: how a turn's typed events (proxy/reply.py) become bytes on each client protocol.

    openai.py      OpenAI chat/completions: SSE chunks, the completion body, OpenAI error bodies
    anthropic.py   Anthropic Messages: the request's translation to the chat shape, SSE events, the
                   message body, Anthropic error bodies

Both implement `Wire` (below): proxy/routes.py serves any turn through one of them. No FastAPI here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from proxy.errors import ProxyError

if TYPE_CHECKING:
    from proxy.normalize import NormalizedChat
    from proxy.turn import Turn

W = TypeVar("W")


class LastChunk(bytes):
    """A stream's last bytes (a turn's end and `[DONE]`): the server sends them with the end of the
    response in one write (proxy/streaming.py), and nothing is read from the stream after them."""

    __slots__ = ()


class Opening(Generic[W]):
    """A streamed answer's first chunk (OpenAI's role chunk, Anthropic's message_start) and the writer
    that goes on from it. The server's turn exchange may send the chunk with the response head the
    moment the engine's 200 arrives (proxy/turn_http.py `EarlyOpen`); `sent` then tells the wire's stream
    not to send it again."""

    __slots__ = ("chunk", "sent", "writer")

    def __init__(self, chunk: bytes, writer: W) -> None:
        self.chunk = chunk
        self.writer = writer
        self.sent = False


class Wire(Protocol):
    route: str  # the metrics label of its endpoint

    def opening(self, chat: NormalizedChat, prompt: Sequence[int]) -> Opening[Any]:
        """The stream's first chunk and its writer, built before the engine answers."""
        ...

    def stream(self, turn: Turn, opening: Opening[Any] | None = None) -> AsyncIterator[bytes]:
        """The whole streamed body (from `opening`, built here if None; its chunk unless already sent),
        its end as one `LastChunk`; a failure after the status line ends it with the wire's error event."""
        ...

    async def complete(self, turn: Turn) -> dict[str, Any]:
        """The non-streamed body (raises ProxyError)."""
        ...

    def error_body(self, exc: ProxyError) -> dict[str, Any]:
        """The JSON body of an error answered before the status line."""
        ...

    def error_event(self, exc: ProxyError) -> bytes:
        """The error that ends a stream whose status line is already sent (a refusal after keep-alives)."""
        ...
