"""Rendering mechanics beyond the spec examples: the chunk cache, continuations that keep a
transcript append-only, ChatML and the generic Jinja fallback against their templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.format import ChatMLFormat, FormatError, JinjaFormat, Qwen3xFormat, load_format, render_template
from proxy.format.cache import ChunkCache
from proxy.format.tokenizer import HFTokenizer, IncrementalDecoder, TiktokenTokenizer
from tests.proxy.test_format_loader import SMOL_TEMPLATE, make_chatml_dir

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def qwen() -> Qwen3xFormat:
    return Qwen3xFormat(TiktokenTokenizer.qwen36())


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chatml_dir(tmp_path_factory.mktemp("smol"))


def _session(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys " * 50}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i} " * 30})
        msgs.append({"role": "assistant", "reasoning": f"think {i}", "content": f"answer {i} " * 30})
    return msgs


# -- cache --------------------------------------------------------------------------------


def test_growing_session_encodes_only_new_messages(qwen: Qwen3xFormat) -> None:
    fmt = Qwen3xFormat(qwen.tokenizer)
    history = _session(20)
    first = fmt.render(history, TOOLS, preserve_thinking=True)
    misses = fmt.cache.misses
    grown = [*history, {"role": "user", "content": "new question " * 30}]
    second = fmt.render(grown, TOOLS, preserve_thinking=True)
    assert fmt.cache.misses == misses + 1  # only the new user turn was tokenized
    assert second.ids[: first.generation.start] == first.ids[: first.generation.start]  # type: ignore[union-attr]
    assert second.ids == fmt.tokenizer.encode(fmt.tokenizer.decode(second.ids))


def test_cache_is_bounded() -> None:
    cache = ChunkCache(lambda s: list(range(len(s))), max_tokens=1000)
    for i in range(50):
        cache.ids(f"{i:04d}" + "x" * 96)
    assert cache.cached_tokens <= 1000 and len(cache) == 10
    with pytest.raises(ValueError):
        ChunkCache(lambda s: [], max_tokens=0)


# -- continuation -------------------------------------------------------------------------


def test_qwen_continuation_after_stop(qwen: Qwen3xFormat) -> None:
    tok = qwen.tokenizer
    first = [{"role": "user", "content": "Q"}]
    prompt = qwen.render(first, TOOLS).ids
    reply = "R\n</think>\n\n<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>"
    generated = tok.encode(reply) + [tok.token_id("<|im_end|>")]  # the engine's ids, stop token included
    new = [{"role": "tool", "content": "out"}, {"role": "user", "content": "more"}]
    cont = qwen.render_continuation(new, TOOLS)
    assert cont[0] == 198  # the "\n" after <|im_end|> that the model never generates
    assistant = {"role": "assistant", "reasoning": "R", "content": "",
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": "x"}}}]}  # fmt: skip
    full = qwen.render([*first, assistant, *new], TOOLS, preserve_thinking=True).ids
    assert prompt + generated + cont == full


def test_qwen_continuation_after_cut_generation(qwen: Qwen3xFormat) -> None:
    cont = qwen.render_continuation([{"role": "user", "content": "go on"}], enable_thinking=False)
    assert (
        qwen.tokenizer.decode(cont)
        == ("<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")[
            len("<|im_end|>") :
        ]
    )
    cut = qwen.render_continuation([{"role": "user", "content": "go on"}], after_stop=False)
    assert qwen.tokenizer.decode(cut).startswith("<|im_end|>\n<|im_start|>user\n")


def test_continue_final_message(qwen: Qwen3xFormat) -> None:
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Sure "}]
    r = qwen.render(msgs, add_generation_prompt=False, continue_final_message=True)
    expected = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nSure"
    assert qwen.tokenizer.decode(r.ids) == expected and r.generation is None
    with pytest.raises(FormatError):
        qwen.render(msgs, add_generation_prompt=True, continue_final_message=True)


def test_span_of_tools_only_system_turn(qwen: Qwen3xFormat) -> None:
    r = qwen.render([{"role": "user", "content": "Hi"}], TOOLS)
    assert r.spans[0].message is None and r.span_of(0) == r.spans[1]
    assert qwen.tokenizer.decode(r.ids[r.spans[1].start : r.spans[1].end]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_developer_is_merged_into_system(qwen: Qwen3xFormat) -> None:
    msgs = [
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "S"},
    ]
    text = qwen.tokenizer.decode(qwen.render(msgs, add_generation_prompt=False).ids)
    assert text == "<|im_start|>system\nD\n\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_bad_tool_schema_is_a_format_error(qwen: Qwen3xFormat) -> None:
    with pytest.raises(FormatError, match="parameters must be a JSON Schema object"):
        qwen.render(
            [{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": [1]}}]
        )


# -- ChatML -------------------------------------------------------------------------------

CHATML_CASES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": " système "}, {"role": "user", "content": "Paris?\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
]


@pytest.mark.parametrize("messages", CHATML_CASES)
@pytest.mark.parametrize("gen", [True, False])
def test_chatml_matches_template(smol_dir: Path, messages: list[dict[str, Any]], gen: bool) -> None:
    fmt = load_format(smol_dir)
    assert isinstance(fmt, ChatMLFormat)
    # vLLM's "string" content format joins text parts with "\n" before the template sees them
    vllm_messages = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
        for m in messages
    ]
    text = render_template(SMOL_TEMPLATE, vllm_messages, add_generation_prompt=gen)
    assert fmt.render(messages, add_generation_prompt=gen).ids == fmt.tokenizer.encode(text)


def test_chatml_continuation_and_parser(smol_dir: Path) -> None:
    fmt = load_format(smol_dir)
    tok = fmt.tokenizer
    first = [{"role": "user", "content": "Hello"}]
    generated = tok.encode("the capital") + [tok.token_id("<|im_end|>")]
    cont = fmt.render_continuation([{"role": "user", "content": "Paris"}])
    full = fmt.render([*first, {"role": "assistant", "content": "the capital"}, {"role": "user", "content": "Paris"}])
    assert fmt.render(first).ids + generated + cont == full.ids
    parser = fmt.parser()
    assert [d.text for d in parser.feed(generated)] == ["the capital"]
    assert parser.result().content == "the capital"


def test_hf_token_bytes_roundtrip(smol_dir: Path) -> None:
    tok = HFTokenizer(smol_dir / "tokenizer.json")
    text = "système prompt ✓ 日本 <|im_end|>"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    dec = IncrementalDecoder(tok)
    assert "".join(dec.feed([i]) for i in ids) + dec.flush() == text


# -- Jinja fallback -----------------------------------------------------------------------


def test_jinja_format_renders_template_with_spans(smol_dir: Path) -> None:
    tok = HFTokenizer(smol_dir / "tokenizer.json")
    fmt = JinjaFormat(tok, SMOL_TEMPLATE, stop_ids=frozenset({2}))
    msgs = CHATML_CASES[2]
    r = fmt.render(msgs)
    assert r.ids == tok.encode(render_template(SMOL_TEMPLATE, msgs, add_generation_prompt=True))
    assert [s.message for s in r.spans] == [0, 1, 2] and r.generation is not None
    assert tok.decode(r.ids[r.spans[1].start : r.spans[1].end]) == "<|im_start|>assistant\nb<|im_end|>\n"
    assert tok.decode(r.ids[: r.spans[0].end]).endswith("<|im_start|>user\na<|im_end|>\n")
    cont = fmt.render_continuation([{"role": "user", "content": "c"}])
    assert tok.decode(cont) == "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def test_ids_past_the_vocabulary_decode_to_nothing(qwen: Qwen3xFormat) -> None:
    tok = qwen.tokenizer
    assert tok.token_bytes(248176) == b"" and tok.decode([12675, 248176]) == "Hi"
    parser = qwen.parser(enable_thinking=False)
    assert [d.text for d in parser.feed([12675, 248176, 12675])] == ["HiHi"]
