"""Byte-exact renders of every example in ../shared/research/qwen-chat-format.md (the spec).

Each case is rendered by our Jinja template (backend/models/templates/qwen3x.jinja) in the
transformers-compatible environment, and, further down, by the Python renderer
(`Qwen3xFormat`), whose output must match the template token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.format.base import FormatError
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.template import TemplateError, render_template
from proxy.format.tokenizer import TiktokenTokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="session")
def qwen_tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer.qwen36()


@pytest.fixture(scope="session")
def qwen(qwen_tokenizer: TiktokenTokenizer) -> Qwen3xFormat:
    return Qwen3xFormat(qwen_tokenizer)


TEMPLATE = (Path(__file__).resolve().parents[2] / "backend" / "models" / "templates" / "qwen3x.jinja").read_text()

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

TOOLS_SYSTEM = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Météo for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": '
    '{"type": "integer"}}, "required": ["city"]}}}\n'
    "</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>\n\nBe brief.<|im_end|>\n"
)


def _call(name: str, arguments: dict[str, Any], call_id: str = "c") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


FULL_HISTORY_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "reasoning_content": "Need two lookups.\n",
        "content": "",
        "tool_calls": [
            _call("get_weather", {"city": "Paris", "days": 2}, "c1"),
            _call("get_weather", {"city": "Rome", "units": None, "detailed": True}, "c2"),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 24}'},
    {"role": "assistant", "reasoning_content": "Compare.", "content": "Paris 18, Rome 24."},
]
FULL_HISTORY = (
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    "Need two lookups.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=units>\nnull\n"
    "</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n'
    '{"temp": 24}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nCompare.\n'
    "</think>\n\nParis 18, Rome 24.<|im_end|>\n"
)
THANKS = "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n"

# (case id, messages, tools, template kwargs, expected text)
SPEC_CASES: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any], str]] = [
    (
        "trimming",
        [
            {"role": "user", "content": "  hi \n"},
            {"role": "assistant", "reasoning_content": "  r  \n", "content": "\n\n A \n"},
            {"role": "tool", "content": "\n out \n"},
        ],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nA<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n",
    ),
    (
        "list-content-image",
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        None,
        {"add_generation_prompt": True},
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n",
    ),
    (
        "list-content-text-joined",
        [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\na b<|im_end|>\n",
    ),
    (
        "vision-ids",
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image"}]},
        ],
        None,
        {"add_generation_prompt": False, "add_vision_id": True},
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Video 1: "
        "<|vision_start|><|video_pad|><|vision_end|>Picture 2: "
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n",
    ),
    (
        "thinking-on",
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}],
        None,
        {"add_generation_prompt": True},
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n",
    ),
    (
        "thinking-off",
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}],
        None,
        {"add_generation_prompt": True, "enable_thinking": False},
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    (
        "no-generation-prompt",
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "no-system",
        [{"role": "user", "content": "Hi"}],
        None,
        {"add_generation_prompt": True},
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
    ),
    (
        "empty-system",
        [{"role": "system", "content": "  \n"}, {"role": "user", "content": "Hi"}],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "tools-system",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [WEATHER_TOOL],
        {"add_generation_prompt": False},
        TOOLS_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "tools-without-system",
        [{"role": "user", "content": "Hi"}],
        [WEATHER_TOOL],
        {"add_generation_prompt": False},
        TOOLS_SYSTEM.replace("\n\nBe brief.", "") + "<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "empty-tools-list",
        [{"role": "user", "content": "Hi"}],
        [],
        {"add_generation_prompt": False},
        "<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "tool-json-nulls",
        [{"role": "user", "content": "Hi"}],
        [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}],
        {"add_generation_prompt": False},
        TOOLS_SYSTEM.replace("\n\nBe brief.", "").replace(
            TOOLS_SYSTEM[TOOLS_SYSTEM.index('{"type"') : TOOLS_SYSTEM.index("\n</tools>")],
            '{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}',
        )
        + "<|im_start|>user\nHi<|im_end|>\n",
    ),
    (
        "content-then-call",
        [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "reasoning_content": "",
                "content": "Let me check.",
                "tool_calls": [_call("f", {"a": "x"})],
            },
        ],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check."
        "\n\n<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n",
    ),
    (
        "argument-values",
        [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call(
                        "f",
                        {
                            "s": "a\n",
                            "n": None,
                            "t": True,
                            "i": 2,
                            "x": 1.0,
                            "l": ["a", "b"],
                            "o": {"x": 1, "y": "é"},
                        },
                    )
                ],
            },
        ],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
        "<function=f>\n<parameter=s>\na\n\n</parameter>\n<parameter=n>\nnull\n</parameter>\n"
        "<parameter=t>\ntrue\n</parameter>\n<parameter=i>\n2\n</parameter>\n<parameter=x>\n1.0\n"
        '</parameter>\n<parameter=l>\n["a", "b"]\n</parameter>\n<parameter=o>\n{"x": 1, "y": "é"}\n'
        "</parameter>\n</function>\n</tool_call><|im_end|>\n",
    ),
    (
        "empty-arguments",
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "tool_calls": [_call("f", {})]},
        ],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
        "<function=f>\n</function>\n</tool_call><|im_end|>\n",
    ),
    ("full-history", FULL_HISTORY_MESSAGES, None, {"add_generation_prompt": False}, FULL_HISTORY),
    (
        "reasoning-from-content",
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA"},
        ],
        None,
        {"add_generation_prompt": False},
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR1\n</think>\n\nA<|im_end|>\n",
    ),
    (
        "next-user-turn-drops-history-thinking",
        [*FULL_HISTORY_MESSAGES, {"role": "user", "content": "Thanks"}],
        None,
        {"add_generation_prompt": True},
        FULL_HISTORY.replace("<think>\nNeed two lookups.\n</think>\n\n", "").replace(
            "<think>\nCompare.\n</think>\n\n", ""
        )
        + THANKS,
    ),
    (
        "next-user-turn-preserve-thinking",
        [*FULL_HISTORY_MESSAGES, {"role": "user", "content": "Thanks"}],
        None,
        {"add_generation_prompt": True, "preserve_thinking": True},
        FULL_HISTORY + THANKS,
    ),
    (
        "history-thinking-off-unchanged",
        [*FULL_HISTORY_MESSAGES, {"role": "user", "content": "Thanks"}],
        None,
        {"add_generation_prompt": True, "enable_thinking": False, "preserve_thinking": True},
        FULL_HISTORY + THANKS.replace("<think>\n", "<think>\n\n</think>\n\n"),
    ),
]

ERROR_CASES: list[tuple[str, list[dict[str, Any]], str]] = [
    (
        "late-system",
        [{"role": "user", "content": "Hi"}, {"role": "system", "content": "S"}],
        "System message must be at the beginning.",
    ),
    (
        "no-user-query",
        [{"role": "system", "content": "S"}, {"role": "tool", "content": "x"}],
        "No user query found in messages.",
    ),
    (
        "only-tool-responses-user",
        [{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}],
        "No user query found in messages.",
    ),
    (
        "unknown-role",
        [{"role": "user", "content": "Hi"}, {"role": "critic", "content": "x"}],
        "Unexpected message role.",
    ),
    (
        "image-in-system",
        [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "Hi"}],
        "System message cannot contain images.",
    ),
]


@pytest.mark.parametrize(
    ("messages", "tools", "kwargs", "expected"),
    [pytest.param(m, t, k, e, id=i) for i, m, t, k, e in SPEC_CASES],
)
def test_template_renders_spec_examples(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], expected: str
) -> None:
    assert render_template(TEMPLATE, messages, tools, **kwargs) == expected


@pytest.mark.parametrize(("messages", "error"), [pytest.param(m, e, id=i) for i, m, e in ERROR_CASES])
def test_template_raises_spec_errors(messages: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(TemplateError, match=error.replace(".", r"\.")):
        render_template(TEMPLATE, messages, None, add_generation_prompt=True)


def test_template_keeps_openai_content_loop() -> None:
    # vLLM picks the "openai" content format by finding a `for ... in <var>.content`-style loop
    # over the content; without it list content would be flattened to a string first.
    assert "for item in content" in TEMPLATE


def test_template_rejects_string_arguments() -> None:
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("f", '{"a": 1}')]},  # type: ignore[arg-type]
    ]
    with pytest.raises(TemplateError, match="must be a mapping"):
        render_template(TEMPLATE, messages, None)


def _render_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    out.setdefault("add_generation_prompt", False)
    out.setdefault("enable_thinking", True)
    return out


@pytest.mark.parametrize(
    ("messages", "tools", "kwargs", "expected"),
    [pytest.param(m, t, k, e, id=i) for i, m, t, k, e in SPEC_CASES],
)
def test_renderer_matches_spec_token_for_token(
    qwen: Qwen3xFormat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    expected: str,
) -> None:
    rendered = qwen.render(messages, tools, **_render_kwargs(kwargs))
    assert qwen.tokenizer.decode(rendered.ids) == expected
    assert rendered.ids == qwen.tokenizer.encode(expected)


@pytest.mark.parametrize(
    ("messages", "tools", "kwargs", "expected"),
    [pytest.param(m, t, k, e, id=i) for i, m, t, k, e in SPEC_CASES],
)
def test_spans_tile_the_prompt(
    qwen: Qwen3xFormat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    expected: str,
) -> None:
    rendered = qwen.render(messages, tools, **_render_kwargs(kwargs))
    pos = 0
    for span in rendered.spans:
        assert span.start == pos and span.end >= span.start
        pos = span.end
    if rendered.generation is not None:
        assert rendered.generation.start == pos
        pos = rendered.generation.end
    assert pos == len(rendered.ids)
    assert [s.message for s in rendered.spans if s.message is not None] == list(range(len(messages)))


@pytest.mark.parametrize(("messages", "error"), [pytest.param(m, e, id=i) for i, m, e in ERROR_CASES])
def test_renderer_raises_spec_errors(qwen: Qwen3xFormat, messages: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(FormatError, match=error.replace(".", r"\.")):
        qwen.render(messages)


COMMON_SEQUENCES = [
    ("<|im_start|>assistant\n<think>\n", [248045, 74455, 198, 248068, 198]),
    ("<think>\n\n</think>\n\n", [248068, 271, 248069, 271]),
    ("<|im_end|>\n", [248046, 198]),
    ("<parameter=days>\n2\n</parameter>", [27, 15704, 28, 13382, 29, 198, 17, 198, 510, 15704, 29]),
    ("\n", [198]),
    ("\n\n", [271]),
    ("\n\n\n", [1358]),
    ('{"x":1}', [4754, 87, 763, 16, 92]),
    ('{"x": 1}', [4754, 87, 763, 220, 16, 92]),
]


@pytest.mark.parametrize(("text", "ids"), COMMON_SEQUENCES)
def test_common_sequences_token_ids(qwen_tokenizer: TiktokenTokenizer, text: str, ids: list[int]) -> None:
    assert qwen_tokenizer.encode(text) == ids


SPEC_TOKEN_IDS = {
    "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|vision_start|>": 248053,
    "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057, "<tool_call>": 248058,
    "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
    "</think>": 248069,
}  # fmt: skip


@pytest.mark.parametrize(("text", "token_id"), sorted(SPEC_TOKEN_IDS.items()))
def test_special_tokens_are_single_ids(qwen_tokenizer: TiktokenTokenizer, text: str, token_id: int) -> None:
    assert qwen_tokenizer.token_id(text) == token_id
    assert qwen_tokenizer.encode(f"a{text}b")[1] == token_id
    assert len(qwen_tokenizer.encode(f"a{text}b")) == 3


@pytest.mark.parametrize("text", ["<function=", "<parameter=", "</parameter>", "</function>", "<tools>"])
def test_xml_markup_is_plain_text(qwen_tokenizer: TiktokenTokenizer, text: str) -> None:
    assert all(i < 248044 for i in qwen_tokenizer.encode(text))
