"""Incremental parser of Qwen3.x output ids: reasoning, content and tool calls.

Follows vLLM 0.32's `qwen3` parser engine (`parser/qwen3.py` + `parser/engine/*`), which serves
both `--reasoning-parser qwen3` and `--tool-call-parser qwen3_coder`:

- states REASONING → CONTENT → tool states; `<think>`, `</think>`, `<tool_call>`,
  `</tool_call>` are recognised by token id only (as vLLM does once it sees ids), the XML
  markup (`<function=`, `>`, `</function>`) by text; other special tokens are dropped;
- a stray `<think>` in reasoning is swallowed, a second `</think>` dropped, `<tool_call>` ends
  reasoning implicitly, no `</think>` means everything is reasoning;
- tolerated: no `</tool_call>` between calls, a bare `<function=`, a missing `</parameter>`
  (the next `<parameter=` closes it); text in a call outside `<function=…>` (e.g. JSON) is
  dropped;
- parameter values lose one leading and one trailing "\\n" and are typed by the tool schema
  (coerce.py); arguments stream as the longest prefix of their JSON that cannot change.

The JSON style (`<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`, vLLM's `hermes`
parser) shares the reasoning rules; a call is emitted whole once its closing tag arrives.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.format import coerce
from proxy.format.base import Delta, DeltaKind, OutputParser, ParsedOutput, ToolCall, ToolCallIdFactory
from proxy.format.normalize import tool_properties
from proxy.format.tokenizer import IncrementalDecoder, Tokenizer

FUNC_PREFIX = "<function="
FUNC_END = "</function>"

_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_PARTIAL_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)


def vllm_tool_call_id() -> str:
    """vLLM's default ("random") tool-call id: `chatcmpl-tool-` + 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def _unwrap(value: str) -> str:
    """Drop the one newline the template puts on each side of a parameter value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def xml_arguments_json(raw: str, *, partial: bool) -> str:
    """The `<parameter=K>V</parameter>` body of a call as a JSON object of strings.

    With `partial`, a trailing parameter that is still open counts with its text so far."""
    params: dict[str, Any] = {m.group(1): _unwrap(m.group(2)) for m in _PARAM.finditer(raw)}
    if partial:
        tail = _PARTIAL_PARAM.search(_PARAM.sub("", raw))
        if tail and tail.group(1):
            params[tail.group(1)] = _unwrap(tail.group(2))
    return json.dumps(params, ensure_ascii=False)


def stable_prefix(args_json: str, string_keys: set[str] | None) -> str:
    """The part of a partial arguments object that later text cannot change: every complete
    member, plus the open string value of the last member when its key can only be a string
    (a number, boolean or object may still re-serialize once the value is complete)."""
    last_colon = -1
    last_key: str | None = None
    pending_key: str | None = None
    in_string = escape = False
    string_start = -1
    depth = 0
    for i, c in enumerate(args_json):
        if escape:
            escape = False
        elif in_string:
            if c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 1 and string_start >= 0:
                    pending_key = args_json[string_start + 1 : i]
        elif c == '"':
            in_string, string_start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending_key = i, pending_key, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(args_json) and args_json[end] in " \t\n\r":
        end += 1
    if end >= len(args_json) or args_json[end] != '"':
        return args_json[:end]
    if string_keys is not None and last_key not in string_keys:
        return args_json[:end]
    escape = False
    for i in range(end + 1, len(args_json)):
        c = args_json[i]
        if escape:
            escape = False
        elif c == "\\":
            escape = True
        elif c == '"':
            return args_json[:i]
    return args_json


class _State(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    PREAMBLE = enum.auto()  # after <tool_call>, before <function=
    NAME = enum.auto()  # inside <function=...
    ARGS = enum.auto()  # after the name's ">"
    BETWEEN = enum.auto()  # after </function>
    JSON_BODY = enum.auto()  # JSON style: inside <tool_call>…</tool_call>


# Text terminals that change state, per state (all others are plain text of the state).
_TERMINALS: dict[_State, tuple[str, ...]] = {
    _State.CONTENT: (FUNC_PREFIX,),
    _State.PREAMBLE: (FUNC_PREFIX,),
    _State.BETWEEN: (FUNC_PREFIX,),
    _State.NAME: (">", FUNC_END),
    _State.ARGS: (FUNC_END,),
}
# Text held back at the end of a chunk while it may still become one of these: the state's
# terminals, and in arguments also the parameter tags (vLLM's lexer buffers every terminal),
# so a streamed value never shows half of "</parameter>".
_HOLD: dict[_State, tuple[str, ...]] = {
    **_TERMINALS,
    _State.ARGS: (FUNC_END, "<parameter=", "</parameter>"),
}


class _Call:
    __slots__ = ("args", "id", "index", "name", "name_sent", "properties", "streamed", "string_keys")

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = ""
        self.name = ""
        self.args = ""
        self.name_sent = False
        self.streamed = ""
        self.string_keys: set[str] | None = None
        self.properties: dict[str, Any] = {}


class Qwen3xParser(OutputParser):
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        style: str = "xml",
        tool_call_id: ToolCallIdFactory | None = None,
        drop_ids: frozenset[int] | None = None,
        tool_calls: bool = True,
    ) -> None:
        """Without `tool_calls` (tool_choice "none") calls are still recognised, so their markup
        stays out of the content, but never reported: vLLM's parser engine suppresses them."""
        self._decoder = IncrementalDecoder(tokenizer)
        self._think_start = tokenizer.token_id("<think>")
        self._think_end = tokenizer.token_id("</think>")
        self._tool_start = tokenizer.token_id("<tool_call>")
        self._tool_end = tokenizer.token_id("</tool_call>")
        markers = {self._think_start, self._think_end, self._tool_start, self._tool_end}
        drops = tokenizer.special_ids if drop_ids is None else drop_ids
        self._drop = frozenset(drops) - markers
        self._tools = list(tools or [])
        self._json_style = style == "json"
        self._new_id = tool_call_id or vllm_tool_call_id
        self._state = _State.REASONING if enable_thinking else _State.CONTENT
        self._pending = ""  # text that may be the start of a terminal
        self._calls: list[_Call] = []
        self._out: list[Delta] = []
        # Output collected for result(): vLLM's non-streaming rules.
        self._reasoning: list[str] = []
        self._content: list[str] = []  # before the first tool call
        self._content_after: list[str] = []  # after it (vLLM keeps it only if no call parsed)
        # Streaming content: whitespace before any real content waits (vLLM defers it, and
        # drops it once a tool call exists).
        self._content_started = False
        self._ws_held = ""
        self._batch_content: list[str] = []
        self._finished = False
        self._suppress = not tool_calls

    @property
    def _has_calls(self) -> bool:
        return bool(self._calls) and not self._suppress

    # -- feeding -------------------------------------------------------------------------

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        run: list[int] = []
        for tid in token_ids:
            if tid in self._drop or tid in (self._think_start, self._think_end, self._tool_start, self._tool_end):
                if run:
                    self._text(self._decoder.feed(run))
                    run = []
                self._text(self._decoder.flush(), final=True)
                if tid not in self._drop:
                    self._marker(tid)
            else:
                run.append(tid)
        if run:
            self._text(self._decoder.feed(run))
        return self._flush_batch(finished=False)

    def finish(self) -> list[Delta]:
        if not self._finished:
            self._finished = True
            self._text(self._decoder.flush(), final=True)
            open_call = _State.PREAMBLE, _State.NAME, _State.ARGS, _State.BETWEEN, _State.JSON_BODY
            if self._state in open_call and self._calls:
                self._end_call()
            self._state = _State.CONTENT
        return self._flush_batch(finished=True)

    def _marker(self, tid: int) -> None:
        """A think/tool-call marker id; (state, marker) pairs without a transition are text."""
        s = self._state
        if tid == self._think_start:
            if s is not _State.REASONING:
                self._emit(s, "<think>")
        elif tid == self._think_end:
            if s is _State.REASONING:
                self._state = _State.CONTENT
            elif s is not _State.CONTENT:
                self._emit(s, "</think>")
        elif tid == self._tool_start:
            if s in (_State.REASONING, _State.CONTENT, _State.BETWEEN):
                self._start_call()
                self._state = _State.JSON_BODY if self._json_style else _State.PREAMBLE
            else:
                self._emit(s, "<tool_call>")
        elif tid == self._tool_end:
            if s is _State.PREAMBLE or s is _State.JSON_BODY:
                self._end_call()
                self._state = _State.CONTENT
            elif s is _State.BETWEEN:
                self._state = _State.CONTENT
            else:
                self._emit(s, "</tool_call>")

    def _text(self, text: str, *, final: bool = False) -> None:
        """Split text at the current state's terminals; hold back a possible partial one."""
        buf = self._pending + text
        self._pending = ""
        while buf:
            terms = _TERMINALS.get(self._state, ()) if not self._json_style else ()
            hit, term = -1, ""
            for t in terms:
                i = buf.find(t)
                if i >= 0 and (hit < 0 or i < hit):
                    hit, term = i, t
            if hit < 0:
                hold = _HOLD.get(self._state, ()) if not self._json_style else ()
                keep = 0 if final else _partial_suffix(buf, hold)
                self._emit(self._state, buf[: len(buf) - keep])
                self._pending = buf[len(buf) - keep :]
                return
            self._emit(self._state, buf[:hit])
            buf = buf[hit + len(term) :]
            self._terminal(term)

    def _terminal(self, term: str) -> None:
        s = self._state
        if term == FUNC_PREFIX:  # from CONTENT, PREAMBLE or BETWEEN
            if s is not _State.PREAMBLE:
                self._start_call()
            self._state = _State.NAME
        elif term == ">":  # NAME → ARGS
            self._state = _State.ARGS
            call = self._calls[-1]
            if call.name:
                self._send_name(call)
        elif term == FUNC_END:  # NAME or ARGS → BETWEEN
            self._end_call()
            self._state = _State.BETWEEN

    def _emit(self, state: _State, text: str) -> None:
        if not text:
            return
        if state is _State.REASONING:
            self._reasoning.append(text)
            self._out.append(Delta(DeltaKind.REASONING, text))
        elif state is _State.CONTENT:
            (self._content_after if self._has_calls else self._content).append(text)
            self._batch_content.append(text)
        elif state is _State.NAME:
            self._calls[-1].name += text
        elif state is _State.ARGS or state is _State.JSON_BODY:
            self._calls[-1].args += text
        # PREAMBLE / BETWEEN: dropped, as vLLM does.

    # -- tool calls ----------------------------------------------------------------------

    def _start_call(self) -> None:
        self._calls.append(_Call(len(self._calls)))

    def _send_name(self, call: _Call, arguments: str | None = None) -> None:
        call.name_sent = True
        call.id = self._new_id()
        call.properties = tool_properties(self._tools, call.name)
        call.string_keys = coerce.string_only_keys(call.properties)
        self._out.append(Delta(DeltaKind.TOOL_CALL, index=call.index, id=call.id, name=call.name))
        if arguments:
            self._out.append(Delta(DeltaKind.ARGUMENTS, arguments, index=call.index))

    def _stream_args(self, call: _Call) -> None:
        if not call.name_sent or self._json_style:
            return
        current = coerce.fix_argument_types(xml_arguments_json(call.args, partial=True), call.properties)
        safe = stable_prefix(current, call.string_keys)
        if safe and safe != call.streamed and safe.startswith(call.streamed):
            self._out.append(Delta(DeltaKind.ARGUMENTS, safe[len(call.streamed) :], index=call.index))
            call.streamed = safe

    def _final_args(self, call: _Call) -> str:
        if self._json_style:
            return _json_call(call.args)[1]
        if not call.args.strip():
            return "{}"
        return coerce.fix_argument_types(xml_arguments_json(call.args, partial=False), call.properties)

    def _end_call(self) -> None:
        call = self._calls[-1]
        if self._json_style and not call.name:
            call.name = _json_call(call.args)[0]
        if not call.name_sent:
            if not call.name:
                return  # vLLM drops a call without a name
            self._send_name(call)
            final = self._final_args(call)
            self._out.append(Delta(DeltaKind.ARGUMENTS, final, index=call.index))
            call.streamed = final
            return
        final = self._final_args(call)
        if len(final) > len(call.streamed) and final.startswith(call.streamed):
            self._out.append(Delta(DeltaKind.ARGUMENTS, final[len(call.streamed) :], index=call.index))
            call.streamed = final

    # -- batching ------------------------------------------------------------------------

    def _flush_batch(self, *, finished: bool) -> list[Delta]:
        if self._calls and self._calls[-1].name_sent and self._state is _State.ARGS:
            self._stream_args(self._calls[-1])
        if self._batch_content:
            text = "".join(self._batch_content)
            self._batch_content = []
            if not self._content_started:
                text = self._ws_held + text
                self._ws_held = ""
                if text.strip():
                    self._content_started = True
                elif self._has_calls:
                    text = ""
                elif not finished:
                    self._ws_held, text = text, ""
            if text:
                self._out.append(Delta(DeltaKind.CONTENT, text))
        elif finished and self._ws_held and not self._has_calls:
            self._out.append(Delta(DeltaKind.CONTENT, self._ws_held))
            self._ws_held = ""
        out, self._out = self._out, []
        if self._suppress:
            out = [d for d in out if d.kind is DeltaKind.CONTENT or d.kind is DeltaKind.REASONING]
        return out

    # -- result --------------------------------------------------------------------------

    def result(self) -> ParsedOutput:
        calls = tuple(
            ToolCall(c.id, c.name.strip() if not self._json_style else c.name, self._final_args(c))
            for c in self._calls
            if c.name_sent and not self._suppress
        )
        # vLLM's non-streaming path parses the output as one streaming batch: text after the
        # first call is deferred and lost once a call was parsed; whitespace-only content is
        # dropped when a call was opened; content is stripped when calls were parsed.
        content = "".join(self._content)
        if not any(c.name_sent for c in self._calls):
            content += "".join(self._content_after)
        if self._has_calls and not content.strip():
            content = ""
        if calls:
            content = content.strip()
        return ParsedOutput(content or None, "".join(self._reasoning) or None, calls)


def _partial_suffix(buf: str, terms: Sequence[str]) -> int:
    """Length of the longest end of `buf` that is a proper prefix of a terminal."""
    best = 0
    for t in terms:
        for n in range(min(len(t) - 1, len(buf)), best, -1):
            if buf.endswith(t[:n]):
                best = n
                break
    return best


def _json_call(body: str) -> tuple[str, str]:
    """(name, arguments JSON) of a Hermes-style call body; ("", "{}") when it is not JSON."""
    try:
        parsed = json.loads(body.strip())
    except ValueError:
        return "", "{}"
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return "", "{}"
    args = parsed.get("arguments", {})
    return parsed["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
