"""Render a chat template the way vLLM 0.32 does (through transformers' `apply_chat_template`).

vLLM hands the template to transformers, whose Jinja environment differs from a plain
`jinja2.Environment` in ways that change bytes: `trim_blocks`/`lstrip_blocks`, a `tojson` that
neither sorts keys nor HTML-escapes (plain Jinja does both), `raise_exception` and
`strftime_now` globals, and the `loopcontrols` extension. We rebuild that environment here so a
template renders identically without importing transformers (which costs seconds at import).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: key order as received, non-ASCII kept, no HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text; compiled templates are immutable and thread-safe."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """Render `source` as transformers would: `messages`, `tools`, `add_generation_prompt` and
    the chat-template kwargs (e.g. `enable_thinking`) are the template's variables."""
    template = compile_template(source)
    try:
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
