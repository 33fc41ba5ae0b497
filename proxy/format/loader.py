"""`load_format(model_dir)`: the ChatFormat of a prepared model directory.

The model preparation writes `hyperharness.json` next to config.json / tokenizer.json /
tokenizer_config.json:
    {"name": ..., "chat_format": "qwen3x" | "chatml" | "jinja", "bpe_ranks": <file> | null,
     "context_length": N}
Tokenizer: tiktoken over `bpe_ranks` when given (added tokens and split regex from
tokenizer.json), else HF tokenizers over tokenizer.json. Stop ids: the eos ids of
generation_config.json (what vLLM stops on) plus the format's end-of-turn token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.format.base import ChatFormat, FormatError
from proxy.format.chatml import ChatMLFormat
from proxy.format.jinja_format import JinjaFormat
from proxy.format.qwen3x import Qwen3xFormat
from proxy.format.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer, TokenizerError

CHAT_FORMATS = ("qwen3x", "chatml", "jinja")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """What hyperharness.json says about a prepared model directory."""

    name: str
    chat_format: str
    bpe_ranks: Path | None
    context_length: int

    @classmethod
    def read(cls, model_dir: Path) -> ModelFiles:
        meta = _read_json(model_dir / "hyperharness.json")
        unknown = set(meta) - {"name", "chat_format", "bpe_ranks", "context_length"}
        if unknown:
            raise FormatError(f"{model_dir / 'hyperharness.json'}: unknown keys {sorted(unknown)}")
        chat_format = meta.get("chat_format")
        if chat_format not in CHAT_FORMATS:
            raise FormatError(f"{model_dir}: chat_format {chat_format!r} is not one of {CHAT_FORMATS}")
        ranks = meta.get("bpe_ranks")
        if ranks is not None and (not isinstance(ranks, str) or Path(ranks).name != ranks):
            raise FormatError(f"{model_dir}: bpe_ranks must be a file name in the model dir, got {ranks!r}")
        context = meta.get("context_length")
        if not isinstance(context, int) or context <= 0:
            raise FormatError(f"{model_dir}: context_length must be a positive integer, got {context!r}")
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise FormatError(f"{model_dir}: name must be a non-empty string, got {name!r}")
        return cls(name, chat_format, model_dir / ranks if ranks else None, context)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FormatError(f"{path} is missing (is this a prepared model directory?)") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return data


def load_tokenizer(model_dir: Path, ranks: Path | None) -> Tokenizer:
    tokenizer_json = model_dir / "tokenizer.json"
    try:
        if ranks is not None:
            return TiktokenTokenizer.from_files(ranks, tokenizer_json)
        return HFTokenizer(tokenizer_json)
    except TokenizerError as exc:
        raise FormatError(f"{model_dir}: {exc}") from exc


def chat_template(model_dir: Path) -> str:
    """The template vLLM would use: tokenizer_config.json's, else chat_template.jinja."""
    config = _read_json(model_dir / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: vLLM takes "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        return template
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    raise FormatError(f"{model_dir}: no chat template in tokenizer_config.json or chat_template.jinja")


def _token_ids(tokenizer: Tokenizer, values: Any) -> set[int]:
    return {int(v) for v in (values if isinstance(values, list) else [values]) if isinstance(v, int)}


def stop_ids(model_dir: Path, tokenizer: Tokenizer, end_of_turn: str | None) -> frozenset[int]:
    ids: set[int] = set()
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids |= _token_ids(tokenizer, _read_json(gen_path).get("eos_token_id"))
    if end_of_turn is not None and end_of_turn in tokenizer.added_tokens:
        ids.add(tokenizer.token_id(end_of_turn))
    if not ids:
        eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
        eos_text = eos.get("content") if isinstance(eos, Mapping) else eos
        if isinstance(eos_text, str) and eos_text in tokenizer.added_tokens:
            ids.add(tokenizer.token_id(eos_text))
    return frozenset(ids)


def named_special_ids(model_dir: Path, tokenizer: Tokenizer) -> frozenset[int]:
    """transformers' `all_special_ids`: the named special tokens (bos/eos/pad/...) plus the
    extra special tokens of tokenizer_config.json. vLLM's parser engine drops exactly these
    from output text; other added tokens (even "special" ones) stay text."""
    config = _read_json(model_dir / "tokenizer_config.json")
    texts: list[str] = []
    for key, value in config.items():
        if key.endswith("_token") and key != "chat_template":
            text = value.get("content") if isinstance(value, Mapping) else value
            if isinstance(text, str):
                texts.append(text)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, list):
            for t in extra:
                text = t.get("content") if isinstance(t, Mapping) else t
                if isinstance(text, str):
                    texts.append(text)
    return frozenset(tokenizer.token_id(t) for t in texts if isinstance(t, str) and t in tokenizer.added_tokens)


def load_format(model_dir: Path, *, cache_tokens: int = 4_000_000) -> ChatFormat:
    """Build the ChatFormat for a prepared model directory (reads files; ~0.5 s for Qwen)."""
    model_dir = Path(model_dir)
    files = ModelFiles.read(model_dir)
    tokenizer = load_tokenizer(model_dir, files.bpe_ranks)
    if files.chat_format == "qwen3x":
        return Qwen3xFormat(
            tokenizer,
            name=files.name,
            stop_ids=stop_ids(model_dir, tokenizer, "<|im_end|>"),
            drop_ids=named_special_ids(model_dir, tokenizer),
            cache_tokens=cache_tokens,
        )
    template = chat_template(model_dir)
    stops = stop_ids(model_dir, tokenizer, "<|im_end|>" if files.chat_format == "chatml" else None)
    if files.chat_format == "chatml":
        try:
            return ChatMLFormat.from_template(
                tokenizer, template, name=files.name, stop_ids=stops, cache_tokens=cache_tokens
            )
        except FormatError as exc:
            # Not plain ChatML after all: render the model's own template instead.
            log.warning("%s: chat_format chatml does not fit its template (%s); using jinja", model_dir, exc)
    return JinjaFormat(tokenizer, template, name=files.name, stop_ids=stops)
