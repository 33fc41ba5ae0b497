"""Chat formats: render a chat request to the exact prompt ids the engine would build, continue
a transcript token-exactly, and parse generated ids into content, reasoning and tool calls.

Pure Python and synchronous (CPU-bound, microseconds to a few ms per request); no web framework.
"""

from proxy.format.base import (
    ChatFormat,
    Delta,
    DeltaKind,
    FormatError,
    OutputParser,
    ParsedOutput,
    Rendered,
    Span,
    ToolCall,
)
from proxy.format.chatml import ChatMLFormat
from proxy.format.jinja_format import JinjaFormat
from proxy.format.loader import ModelFiles, load_format
from proxy.format.normalize import (
    canonical_arguments,
    canonical_tool,
    canonical_tools,
    content_parts,
    developer_to_system,
    unify_reasoning,
)
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.template import TemplateError, render_template
from proxy.format.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

__all__ = [
    "ChatFormat",
    "ChatMLFormat",
    "Delta",
    "DeltaKind",
    "FormatError",
    "HFTokenizer",
    "JinjaFormat",
    "ModelFiles",
    "OutputParser",
    "ParsedOutput",
    "Qwen3xFormat",
    "Rendered",
    "Span",
    "TemplateError",
    "TiktokenTokenizer",
    "Tokenizer",
    "ToolCall",
    "canonical_arguments",
    "canonical_tool",
    "canonical_tools",
    "content_parts",
    "developer_to_system",
    "load_format",
    "render_template",
    "unify_reasoning",
]
