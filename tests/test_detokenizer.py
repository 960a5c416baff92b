"""Incremental detokenizer: streamed deltas add up to the full decode, UTF-8 safe."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from tests.tiny_models import build_tiny_sentencepiece_gguf

SMOLLM2_VOCAB_SIZE = 49152

# Multi-byte characters that byte-level BPE splits across tokens, plus ASCII and whitespace.
# SmolLM2's vocabulary lacks a few bytes (most C0 controls, lead bytes 0xF1+ of planes 4-16),
# so text using them cannot be encoded at all; leave those out.
text_strategy = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc")),
        st.sampled_from("aé你好🙂👍🏽👨‍👩‍👧 \n\t<|im_end|>𝔘ꙮ"),
    ),
    max_size=40,
)
hypothesis_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    path = build_tiny_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    return Tokenizer.from_path(path)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


def assert_streams_like_full_decode(
    tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], skip: bool
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    final = tokenizer.decode(ids, skip_special_tokens=skip)
    emitted = ""
    for count, token_id in enumerate(ids, start=1):
        emitted += detokenizer.add(token_id)
        assert final.startswith(emitted)  # never emits text a later token changes
        so_far = tokenizer.decode(ids[:count], skip_special_tokens=skip)
        if not so_far.endswith("\ufffd"):
            assert emitted == so_far  # complete text is never held back
    emitted += detokenizer.flush()
    assert emitted == final


@hypothesis_settings
@given(
    ids=st.lists(st.integers(0, SMOLLM2_VOCAB_SIZE - 1), max_size=30),
    prompt=text_strategy,
    skip=st.booleans(),
)
def test_random_ids_stream_to_full_decode(smollm2, ids, prompt, skip) -> None:
    assert_streams_like_full_decode(smollm2, smollm2.encode(prompt), ids, skip)


@hypothesis_settings
@given(
    ids=st.lists(
        st.one_of(st.integers(0, 16), st.integers(17, SMOLLM2_VOCAB_SIZE - 1)), max_size=30
    ),
    skip=st.booleans(),
)
def test_special_tokens_skipped_or_kept(smollm2, ids, skip) -> None:
    assert_streams_like_full_decode(smollm2, [], ids, skip)


@hypothesis_settings
@given(text=text_strategy, prompt=text_strategy, skip=st.booleans())
def test_encoded_unicode_streams_back_to_the_text(smollm2, text, prompt, skip) -> None:
    ids = smollm2.encode(text)
    assert_streams_like_full_decode(smollm2, smollm2.encode(prompt), ids, skip)
    detokenizer = IncrementalDetokenizer(smollm2, [], skip_special_tokens=False)
    assert "".join(stream(detokenizer, ids)) == text


def test_split_character_is_held_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🙂")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    detokenizer = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True)
    deltas = stream(detokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert deltas[-2:] == ["🙂", ""]


def test_prompt_ending_inside_a_character_streams_only_the_output(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ab🙂")
    prompt, output = ids[:-1], ids[-1:] + smollm2.encode(" hi")
    assert smollm2.decode(prompt).endswith("\ufffd")  # the prompt holds part of the emoji
    for skip in (True, False):
        assert_streams_like_full_decode(smollm2, prompt, output, skip)
    detokenizer = IncrementalDetokenizer(smollm2, prompt, skip_special_tokens=True)
    assert "".join(stream(detokenizer, output)).endswith(" hi")


def test_truly_invalid_tail_flushes_as_replacement_char(smollm2: Tokenizer) -> None:
    first_byte_of_emoji = smollm2.encode("🙂")[0]
    ids = smollm2.encode("ok") + [first_byte_of_emoji]
    detokenizer = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas[:-1]) == "ok"
    assert deltas[-1] == "\ufffd" == smollm2.decode(ids)[-1]


def test_window_stays_small(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("word " * 200)
    detokenizer = IncrementalDetokenizer(smollm2, smollm2.encode("prompt " * 50), True)
    for token_id in ids:
        detokenizer.add(token_id)
        # O(1) per token: no re-decode of the whole output
        assert len(detokenizer._context) + len(detokenizer._held) <= 3


# --- SentencePiece-style: byte fallback, and the leading space that depends on context ----------


@hypothesis_settings
@given(text=st.text(alphabet="the quick fox héllo 你好🙂\n", max_size=30), skip=st.booleans())
def test_sentencepiece_byte_fallback_streams_to_full_decode(sentencepiece, text, skip) -> None:
    ids = sentencepiece.encode(text, add_special_tokens=False)
    assert_streams_like_full_decode(sentencepiece, [], ids, skip)


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt(sentencepiece) -> None:
    prompt = sentencepiece.encode("hello")
    output = sentencepiece.encode(" the fox", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(sentencepiece, prompt, skip_special_tokens=True)
    streamed = "".join(stream(detokenizer, output))
    # decode(output) alone would drop the leading space; a continuation must keep it.
    assert sentencepiece.decode(output) == "the fox"
    assert streamed == " the fox"
    assert sentencepiece.decode(prompt + output) == "hello" + streamed


def test_byte_run_that_turns_invalid_after_a_delta_keeps_streaming(sentencepiece) -> None:
    # "l" (byte 0x6C) streams out at once; bytes 0x90 0x30 0x80 then make the run invalid
    # UTF-8, and byte fallback decodes every byte of an invalid run, the "l" too, as U+FFFD.
    # Text already sent cannot be taken back: the stream goes on with what the decode adds.
    ids = [sentencepiece.token_to_id(f"<0x{b:02X}>") for b in (0x6C, 0x90, 0x30, 0x80)]
    ids += sentencepiece.encode("e the fox", add_special_tokens=False)
    full = sentencepiece.decode(ids, skip_special_tokens=False)
    assert full.startswith("\ufffd" * 4)
    detokenizer = IncrementalDetokenizer(sentencepiece, [], skip_special_tokens=False)
    deltas = stream(detokenizer, ids)
    assert deltas[:4] == ["l", "", "", ""]
    assert "".join(deltas) == "l" + full[1:]
