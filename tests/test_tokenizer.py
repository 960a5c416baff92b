"""Tokenizer: parity with transformers for GGUF tokenizers, HF directories, chat templates."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.errors import ModelLoadError, ValidationError
from engine.text.tokenizer import Tokenizer
from tests.tiny_models import build_tiny_sentencepiece_gguf

MIXED_CORPUS = [
    "Hello, world!",
    "  leading spaces\tand\ttabs\n\n\nnewlines  \r\n",
    "      ",
    "digits 12345678901 and 3.14159, 2024-01-31",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦 🇫🇷",
    'def f(x):\n    return {"k": x**2}  # comment\n',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "I'm sure we'll see they've DONE it",
    "ÀÉÎõü ß ø, a\u0301 e\u0301",
    "مرحبا بالعالم",
    "<repo_name>pagedserve<file_sep>engine/tokenizer.py",
    "",
]

SMOLLM_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 🙂"},
    ],
    [
        {"role": "user", "content": "Write a haiku.\nAbout CJK: 俳句"},
        {"role": "assistant", "content": "Sure."},
    ],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


# --- the SmolLM2 GGUF (byte-level BPE, pre "smollm") -------------------------------------------


def test_smollm2_gguf_special_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1
    assert smollm2.eos_token_ids == (2,)
    assert smollm2.add_bos is False
    assert smollm2.all_special_ids == frozenset(range(17))  # the control tokens
    assert smollm2.id_to_token(2) == "<|im_end|>"
    assert smollm2.has_chat_template


def test_smollm2_gguf_loads_fast(smollm2_gguf: Path) -> None:
    start = time.perf_counter()
    Tokenizer.from_path(smollm2_gguf)
    # ~1 s here; generous for a shared CI core, but catches a full GGUFReader parse (~7 s).
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smollm2_encode_matches_transformers(
    smollm2: Tokenizer, smollm2_transformers, add_special_tokens: bool
) -> None:
    for text in MIXED_CORPUS:
        expected = smollm2_transformers.encode(text, add_special_tokens=add_special_tokens)
        assert smollm2.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_smollm2_digits_split_one_by_one(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(" 2024")
    assert [smollm2.decode([i]) for i in ids] == [" ", "2", "0", "2", "4"]


def test_smollm2_special_tokens_in_text_are_single_ids(smollm2: Tokenizer) -> None:
    assert smollm2.encode("<|im_start|>x<|im_end|>") == [1, smollm2.encode("x")[0], 2]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_decode_matches_transformers(
    smollm2: Tokenizer, smollm2_transformers, skip_special_tokens: bool
) -> None:
    sequences = [smollm2.encode(text) for text in MIXED_CORPUS]
    rng = random.Random(1234)  # random ids split characters and hit special tokens
    sequences += [
        [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(200)
    ]
    for ids in sequences:
        expected = smollm2_transformers.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smollm2.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_smollm2_round_trips_text(smollm2: Tokenizer) -> None:
    for text in MIXED_CORPUS:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", SMOLLM_CONVERSATIONS)
def test_smollm2_chat_template_matches_transformers(
    smollm2: Tokenizer, smollm2_transformers, conversation, add_generation_prompt: bool
) -> None:
    expected = smollm2_transformers.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    rendered = smollm2.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_rejects_bad_messages(smollm2: Tokenizer) -> None:
    for messages in ([], [{"content": "no role"}], ["not a dict"]):
        with pytest.raises(ValidationError) as info:
            smollm2.apply_chat_template(messages)
        assert info.value.field == "messages"


# --- SentencePiece-style GGUF ("llama": byte fallback, merges from scores) ---------------------


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    return build_tiny_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name
    )
    ours = Tokenizer.from_path(sentencepiece_gguf)
    assert ours.add_bos and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    texts = MIXED_CORPUS + ["the quick brown fox", "<s>the</s> <|user|>x", " hello  world"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # BOS added, as llama.cpp does for SentencePiece vocabularies
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_byte_fallback_round_trips(sentencepiece_gguf: Path) -> None:
    ours = Tokenizer.from_path(sentencepiece_gguf)
    text = "héllo 你好 🙂 fox"
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.token_to_id("<0xF0>") in ids  # the emoji's first byte, outside the pieces
    assert ours.decode(ids) == text


def test_unsupported_gguf_tokenizer_model_is_named(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]", "hello"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        Tokenizer.from_path(tmp_path / "bert.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Tokenizer.from_path(tmp_path / "fake.gguf")


# --- HF directory --------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_hf_tokenizer_dir(directory: Path, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """A small byte-level BPE trained in-process, saved the way HF model repos ship it."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(
        ["hello world", "the quick brown fox", "serving tokens fast", "日本語"] * 10, trainer
    )
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return directory


def test_hf_dir_loads_and_round_trips(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_path(build_hf_tokenizer_dir(tmp_path / "model"))
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (0, 2)  # generation_config's list, tokenizer eos included
    assert tokenizer.add_bos is False  # the post-processor adds nothing
    assert tokenizer.all_special_ids == frozenset({0, 1, 2})
    for text in ["hello world", "the quick 🦊 fox\n\tjumps", "日本語 and 中文"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_hf_dir_chat_template_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = build_hf_tokenizer_dir(tmp_path / "model")
    ours = Tokenizer.from_path(directory)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.apply_chat_template(conversation, add_generation_prompt) == expected
    assert ours.apply_chat_template(conversation).startswith("<|im_start|><|im_start|>user\n")


def test_chat_template_jinja_file_wins_over_config(tmp_path: Path) -> None:
    directory = build_hf_tokenizer_dir(tmp_path / "model")
    (directory / "chat_template.jinja").write_text("FILE{{ messages | length }}")
    tokenizer = Tokenizer.from_path(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "FILE1"


def test_no_chat_template_is_a_validation_error(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_path(build_hf_tokenizer_dir(tmp_path / "m", chat_template=None))
    assert not tokenizer.has_chat_template
    with pytest.raises(ValidationError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"
    assert "no chat template" in str(info.value)


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_path(tmp_path)


def test_template_features_hf_templates_rely_on(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content | tojson }}]{% endgeneration %}\n"
        "{% endfor %}{{ strftime_now('%Y') | length }} {{ eos_token }} {{ tools is none }}"
        " {{ custom }}"
    )
    tokenizer = Tokenizer.from_path(build_hf_tokenizer_dir(tmp_path / "m", chat_template=template))
    messages = [
        {"role": "skip", "content": "x"},
        {"role": "user", "content": 'é "quoted" <b>'},
        {"role": "user", "content": "never"},
    ]
    rendered = tokenizer.apply_chat_template(messages, custom="extra")
    # trim_blocks eats the newline after a block tag; tojson neither escapes HTML nor non-ASCII.
    assert rendered == '["é \\"quoted\\" <b>"]4 <|im_end|> True extra'


def test_template_raise_exception_and_sandbox(tmp_path: Path) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    tokenizer = Tokenizer.from_path(build_hf_tokenizer_dir(tmp_path / "a", chat_template=template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ValidationError, match="first must be user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": ""}])

    escape = "{{ messages.__class__.__mro__ }}"
    sandboxed = Tokenizer.from_path(build_hf_tokenizer_dir(tmp_path / "b", chat_template=escape))
    with pytest.raises(ValidationError):
        sandboxed.apply_chat_template([{"role": "user", "content": ""}])


def test_template_that_does_not_parse_fails_at_load(tmp_path: Path) -> None:
    directory = build_hf_tokenizer_dir(tmp_path / "m", chat_template="{% for m in messages %}")
    with pytest.raises(ModelLoadError, match="chat template"):
        Tokenizer.from_path(directory)
