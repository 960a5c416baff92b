"""The prompt encoder every door uses: text, chat messages or token ids to checked ids."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from engine.text.prompts import MAX_CHAT_MESSAGES, PromptEncoder
from engine.text.tokenizer import Tokenizer
from tests.tiny_models import (
    CHAT_TEMPLATE,
    TOKENIZER_VOCAB_SIZE,
    tiny_tokenizer_json,
    write_tiny_model,
)

CONTEXT = 32
BOUNDS = " (model 64, KV pool 32)"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(
        BackendTokenizer.from_str(tiny_tokenizer_json()),
        vocab_size=TOKENIZER_VOCAB_SIZE,
        bos_token_id=None,
        eos_token_ids=[0],
        add_bos=False,
        special_tokens={},
        chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture
def prompts(tokenizer: Tokenizer) -> PromptEncoder:
    return PromptEncoder(tokenizer, TOKENIZER_VOCAB_SIZE, CONTEXT, BOUNDS)


def refusal(call) -> ValidationError:
    with pytest.raises(ValidationError) as err:
        call()
    return err.value


def test_each_form_encodes_as_the_tokenizer_does(prompts, tokenizer):
    assert prompts.prompt("Hello, world!") == tokenizer.encode("Hello, world!")
    messages = [{"role": "user", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chat = tokenizer.encode(rendered, add_special_tokens=False)
    assert prompts.prompt(messages=messages) == chat
    assert prompts.prompt(token_ids=(5, 6, 7)) == [5, 6, 7]


def test_messages_become_the_templates_dicts_through_as_dict(prompts):
    class Message:
        role, content = "user", "Hello"

    def as_dict(m: Message) -> dict[str, str]:
        return {"role": m.role, "content": m.content}

    want = prompts.prompt(messages=[{"role": "user", "content": "Hello"}])
    assert prompts.prompt(messages=[Message()], as_dict=as_dict) == want


def test_exactly_one_form(prompts):
    err = refusal(lambda: prompts.prompt("x", token_ids=[1]))
    assert str(err) == "prompt: give exactly one of prompt, prompt_token_ids, messages"
    assert refusal(lambda: prompts.prompt()).field == "prompt"
    err = refusal(lambda: prompts.tokenize("x", messages=[]))
    assert str(err) == "prompt: give exactly one of prompt, messages"


@pytest.mark.parametrize(
    ("ids", "field", "message"),
    [
        ([], "prompt", "must not be empty"),
        (
            [1, -3],
            "prompt_token_ids",
            f"token 1 is -3, expected an integer in [0, {TOKENIZER_VOCAB_SIZE})",
        ),
        ([1, True], "prompt_token_ids", "token 1 is True, expected"),
        ([1, 2.0], "prompt_token_ids", "token 1 is 2.0, expected"),
        (
            [TOKENIZER_VOCAB_SIZE],
            "prompt_token_ids",
            f"token 0 is {TOKENIZER_VOCAB_SIZE}, expected",
        ),
        (
            [1] * CONTEXT,
            "prompt",
            f"{CONTEXT} tokens leave no room to generate: the context limit is {CONTEXT} tokens"
            + BOUNDS,
        ),
    ],
)
def test_a_bad_prompt_is_refused_naming_its_field(prompts, ids, field, message):
    err = refusal(lambda: prompts.prompt(token_ids=ids))
    assert err.field == field and err.message.startswith(message), err


def test_max_tokens_must_fit_beside_the_prompt(prompts):
    assert prompts.check([1] * 10) == CONTEXT - 10  # unset: up to the context limit
    assert prompts.check([1] * 10, max_tokens=CONTEXT - 10) == CONTEXT - 10
    err = refusal(lambda: prompts.check([1] * 10, max_tokens=CONTEXT - 9))
    assert err.field == "max_tokens"
    assert err.message == (
        f"prompt (10 tokens) + max_tokens ({CONTEXT - 9}) exceeds the context limit of "
        f"{CONTEXT} tokens{BOUNDS}"
    )


def test_text_and_chat_that_cannot_fit_are_refused_unencoded(prompts, tokenizer):
    long = "a" * (CONTEXT * tokenizer.max_token_chars + 1)
    assert refusal(lambda: prompts.prompt(long)).field == "prompt"
    assert refusal(lambda: prompts.tokenize(long, field="text")).field == "text"
    chat = [{"role": "user", "content": long}]
    assert refusal(lambda: prompts.prompt(messages=chat)).field == "messages"


def test_tokenize_does_not_hold_text_to_the_context(prompts, tokenizer):
    text = "Hello, world! " * 8  # more tokens than the context, fewer characters than its bound
    ids = prompts.tokenize(text)
    assert len(ids) >= CONTEXT and ids == tokenizer.encode(text)


def test_chat_messages_are_counted_before_they_are_copied(prompts):
    copied = []

    def as_dict(m: dict) -> dict:
        copied.append(m)
        return m

    too_many = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    err = refusal(lambda: prompts.prompt(messages=too_many, as_dict=as_dict))
    assert err.field == "messages" and not copied


def test_the_engine_checks_the_ids_it_is_handed(tmp_path):
    model = write_tiny_model(tmp_path, "llama")
    engine = LLMEngine(engine_config_from_flat(model=str(model), num_blocks=8, block_size=4))
    err = refusal(lambda: engine.add_request("r", [1, 10**6], SamplingParams(max_tokens=2)))
    assert err.field == "prompt_token_ids" and not engine.requests
    err = refusal(lambda: engine.add_request("r", [1] * 20, SamplingParams(max_tokens=20)))
    assert err.field == "max_tokens" and "KV pool 32)" in err.message
