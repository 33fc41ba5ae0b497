"""Request normalization on the serving side: each quirk a named function, applied by `normalize()`.

Why each exists (shared/research/harnesses.md §4, proxy_anchors.md §6): harnesses send OpenAI-only
fields vLLM does not know (`store`, `strict`, ...), re-order tool-definition keys between turns, and ask
for more `max_tokens` than the room left, which must be capped rather than reported as an overflow.
(The thinking switch, said four different ways, is read once by proxy/ingress.py.)

Message-level normalization that changes the rendered prompt (`developer` → `system` with vLLM's
system merge, the reasoning field name, string tool arguments → objects) is vLLM's own preprocessing
and lives with the renderer (proxy/format/normalize.py), so prompt ids stay equal to vLLM's; the
tolerant comparison of histories lives in proxy/transcripts.py (`message_key`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from proxy import constraints
from proxy.constraints import ToolChoice
from proxy.errors import ContextLengthExceeded, InvalidRequest
from proxy.protocol import ChatRequest

# Sampling fields forwarded to vLLM /v1/completions; everything else is dropped (store, metadata,
# prompt_cache_key, prompt_cache_retention, service_tier, ...). `response_format`, `tool_choice` and
# `logprobs` are mapped by proxy/constraints.py.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
)
# vLLM extensions passed through as sent (tests force exact outputs with `structured_outputs`).
VLLM_EXTRA_FIELDS = ("structured_outputs", "min_tokens", "ignore_eos", "logit_bias")


@dataclass(frozen=True, slots=True)
class NormalizedChat:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    tool_choice: ToolChoice = constraints.AUTO
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids / token_ids in the response
    logprobs: int | None = None  # top_logprobs count when the client asked for logprobs
    parallel_tool_calls: bool = True
    tools_key: str = "[]"  # `tools_key(tools)`: the transcript context's and the session fingerprint's


def stable_tool_definitions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as rendered: `strict` dropped (OpenAI-only); order and key order kept as sent, since that
    is what the template (and vLLM) render. Identity uses `tools_key`, which is order-insensitive."""
    if not tools:
        return None
    out = []
    for tool in tools:
        fn = {k: v for k, v in tool.get("function", {}).items() if k != "strict"}
        out.append({**{k: v for k, v in tool.items() if k != "strict"}, "function": fn})
    return out


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    """Canonical serialization of tool definitions: sorted keys, compact, so re-ordered keys match.

    msgspec's sorted encoding, not `json.dumps(sort_keys=True)`: the same text but for exponents
    (`1e16`, not `1e+16`), 8x faster (58 vs 473 us for a coding harness's 30 KB of tools, every turn)."""
    return msgspec.json.encode(tools or [], order="sorted").decode()


# The largest tool set whose text a per-process cache keeps (a coding harness sends 30-60 KB); bigger
# ones are handled afresh each turn, so a cache of `keep` entries stays within keep x this.
CACHED_TOOLS_CHARS = 256 * 1024


class ToolsSeen:
    """Tool sets whose schemas passed `constraints.check_tool_schemas`, by `tools_key`: a harness sends
    the same tools every turn, and checking a coding harness's 20 schemas costs 340 us each time; a
    set seen before costs a lookup. The least recently seen go past `keep` (a few per harness)."""

    def __init__(self, keep: int = 32) -> None:
        self.keep = keep
        self._passed: OrderedDict[str, None] = OrderedDict()

    def check(self, tools: list[dict[str, Any]] | None, key: str) -> None:
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        constraints.check_tool_schemas(tools)  # raises the 400 naming the tool
        if len(key) > CACHED_TOOLS_CHARS:
            return
        self._passed[key] = None
        if len(self._passed) > self.keep:
            self._passed.popitem(last=False)


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    """The client's extra template kwargs. The thinking switch is not among them: ingress decides it
    once (proxy/quirks.py `thinking_switch`) and the turn passes it to the renderer by name."""
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.pop("enable_thinking", None)
    return kwargs


def drop_unsupported_fields(req: ChatRequest) -> dict[str, Any]:
    """Only the sampling fields vLLM's completions endpoint understands survive."""
    sampling = {}
    for name in SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not None:
            sampling[name] = value
    extra = req.model_extra or {}
    for name in VLLM_EXTRA_FIELDS:
        if extra.get(name) is not None:
            sampling[name] = extra[name]
    if "structured_outputs" in sampling:  # goes to the engine's grammar compiler as sent: same limits
        constraints.check_structured_outputs(sampling["structured_outputs"])
    sampling.pop("logprobs", None)
    sampling.pop("top_logprobs", None)
    top = constraints.top_logprobs(req.logprobs, req.top_logprobs)
    if top is not None:
        sampling["logprobs"] = top
        # Ids rather than decoded strings as logprob keys: exact bytes, no collisions in top_logprobs.
        sampling["return_tokens_as_token_ids"] = True
    outputs = constraints.response_format_outputs(req.response_format)
    if outputs is not None:
        # response_format overrides the constraint kinds it sets, as vLLM's own merge does.
        given = sampling.get("structured_outputs")
        base = {k: v for k, v in given.items() if k not in _CONSTRAINT_KINDS} if isinstance(given, dict) else {}
        sampling["structured_outputs"] = {**base, **outputs}
    return sampling


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def check_generation_fields(body: Mapping[str, Any]) -> None:
    """The limits of the chat path for a body relayed to vLLM as is (/v1/completions and the rest of the
    pass-through): the same `n`, `logprobs` and structured-output bounds, so no route reaches the
    engine's sampler or grammar compiler with what the chat route refuses."""
    n = body.get("n")
    if n is not None and n != 1:
        raise InvalidRequest(f"n={n!r} is not supported (only 1)", param="n")
    for name in ("logprobs", "prompt_logprobs", "top_logprobs"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool) and (
                not isinstance(value, int) or not 0 <= value <= constraints.MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"{name} must be between 0 and {constraints.MAX_TOP_LOGPROBS}", param=name)
    if body.get("structured_outputs") is not None:
        constraints.check_structured_outputs(body["structured_outputs"])
    if body.get("response_format") is not None:
        constraints.response_format_outputs(body["response_format"])
    if body.get("chat_template") is not None or body.get("chat_template_kwargs") is not None:
        raise InvalidRequest("chat_template and chat_template_kwargs are not accepted on this route",
                             param="chat_template")
    constraints.check_tool_schemas(body.get("tools") if isinstance(body.get("tools"), list) else None)


def has_constraint(sampling: Mapping[str, Any]) -> bool:
    so = sampling.get("structured_outputs")
    return isinstance(so, dict) and any(so.get(k) not in (None, False) for k in _CONSTRAINT_KINDS)


def cap_max_tokens(requested: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The output budget: the room left in the context, or less if asked. Only a prompt that does not
    fit at all is an overflow (and only then says "maximum context length is N tokens")."""
    room = max_model_len - prompt_tokens
    if room <= 0:
        raise ContextLengthExceeded(max_model_len, prompt_tokens)
    if requested is None or requested > room:
        return room
    return max(requested, 1)


def normalize(req: ChatRequest, body: Mapping[str, Any], seen: ToolsSeen | None = None) -> NormalizedChat:
    """`req` is `body` validated; messages and tools are taken from `body` as sent (no re-dump of a
    100K-token history), since the renderer applies vLLM's message preprocessing itself. `seen`: the
    tool sets already checked (the ingress keeps one); without it the set is checked."""
    messages = list(body["messages"])
    tools = stable_tool_definitions(list(body["tools"]) if req.tools else None)
    key = tools_key(tools)
    (seen or ToolsSeen()).check(tools, key)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    choice = constraints.tool_choice(req.tool_choice, tools)
    sampling = drop_unsupported_fields(req)
    if choice.forced and has_constraint(sampling):
        raise InvalidRequest(
            "tool_choice that forces a tool call cannot be combined with response_format or structured"
            " outputs: use one or the other",
            param="tool_choice",
        )
    return NormalizedChat(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs(req),
        sampling=sampling,
        max_tokens=requested,
        stream=req.stream,
        include_usage=include_usage,
        tool_choice=choice,
        return_token_ids=(req.model_extra or {}).get("return_token_ids") is True,
        logprobs=sampling.get("logprobs"),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tools_key=key,
    )
