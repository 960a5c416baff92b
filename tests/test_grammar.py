"""Constraints and their token masks, on the embedded default's real tokenizer: what is
refused (by name, before and at compiling), what each mask lets through."""

from __future__ import annotations

import json
import os
import signal
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
from llguidance import LLParserLimits
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import EngineOverloaded, ValidationError
from engine.sampling_params import SamplingParams
from engine.structured import grammar
from engine.structured.constraints import MAX_CHOICES, Constraint
from engine.structured.grammar import GrammarCompiler, start_filling
from engine.text.tokenizer import Tokenizer
from tests.json_schemas import slow_schema

SLOW_SCHEMA = slow_schema(2000)  # ~0.2 s to build on one CPU core
# Every string of a and b, each in exponentially many ways: its masks grow with each token.
AMBIGUOUS = 'start: s\ns: s s s | s s | "a" | "b"'


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def masks_of(compiler: GrammarCompiler, constraint: Constraint):
    """Makes a candidate's mask of the constraint each call."""
    return compiler.masks(constraint, compiler.compile(constraint))


def allowed_ids(mask, vocab_size: int) -> list[int]:
    bitmask = np.full(-(-vocab_size // 32), -1, dtype=np.int32)
    mask.fill_next(bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint("xml", "<a/>", field="f"), "unknown kind"),
        (Constraint("choice", (), field="f"), "at least one"),
        (Constraint("choice", ("a", ""), field="f"), "entry 1"),
        (Constraint("choice", ("a",) * (MAX_CHOICES + 1), field="f"), "at most"),
        (Constraint("regex", "", field="f"), "non-empty"),
        (Constraint("grammar", "   ", field="f"), "non-empty"),
        (Constraint("json_schema", "{not json", field="f"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]", field="f"), "object or a boolean"),
    ],
)
def test_what_is_wrong_short_of_compiling_is_refused_by_field(constraint, message) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        constraint.validate()
    assert caught.value.field == "f"


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint("regex", "[0-9", field="regex"), "unclosed character class"),
        (Constraint("grammar", "root ::= [", field="grammar"), "cannot be compiled"),
        (Constraint("grammar", "start: (", field="grammar"), "cannot be compiled"),
        (Constraint("json_schema", '{"type": "foo"}', field="json_schema"), "Invalid type: foo"),
    ],
)
def test_what_the_compiler_refuses_names_the_field_and_says_why_in_one_line(
    compiler: GrammarCompiler, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        compiler.compile(constraint)
    assert caught.value.field == constraint.field
    assert "\n" not in str(caught.value)


def test_a_compile_past_the_time_limit_is_refused_with_its_own_error(tokenizer) -> None:
    slow = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, 0.03)
    with pytest.raises(ValidationError, match="did not compile within 0.03 s") as caught:
        slow.compile(Constraint("json_schema", SLOW_SCHEMA, field="response_format"))
    assert caught.value.field == "response_format"


def test_a_constraint_that_gets_no_thread_in_time_is_told_to_retry_and_is_never_built(
    tokenizer,
) -> None:
    """The time limit is the build's own: a constraint queued behind another's build is
    refused as the server's fault (retry later), not its own, and is not built afterwards."""
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, time_limit=0.05, threads=1
    )
    slow = compiler.start(Constraint("json_schema", SLOW_SCHEMA, field="response_format"))
    queued = compiler.start(Constraint("regex", "[0-9]+", field="regex"))
    with pytest.raises(EngineOverloaded, match="^regex: no grammar compile thread was free"):
        queued.matcher(wait=True)
    with pytest.raises(ValidationError, match="did not compile within 0.05 s"):
        slow.matcher(wait=True)
    futures.wait([slow.future])  # the slow build runs on, unread, to its end
    assert queued.future.cancelled()
    assert (compiler.stats().builds, compiler.stats().cache_hits) == (1, 0)
    # The thread is free again: the same regex compiles, then comes from the cache.
    compiler.compile(Constraint("regex", "[0-9]+", field="regex"))
    compiler.compile(Constraint("regex", "[0-9]+", field="regex"))
    stats = compiler.stats()
    assert (stats.builds, stats.cache_hits) == (2, 1)
    assert list(stats.builds_within) == sorted(stats.builds_within) and stats.builds_within[-1] <= 2
    assert stats.build_seconds > 0.05  # the slow build ran past its limit, then to its end


def test_a_choice_mask_keeps_the_text_a_prefix_of_a_choice_then_allows_only_eos(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    choices = ("yes", 'no "way"', "naïve ☃")
    mask = masks_of(compiler, Constraint("choice", choices))()
    vocab = tokenizer.vocab_size
    first = allowed_ids(mask, vocab)
    texts = {tokenizer.decode([t], skip_special_tokens=False) for t in first}
    assert texts and all(any(c.startswith(t) for c in choices) for t in texts)
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        mask.accept(token_id)
    assert allowed_ids(mask, vocab) == sorted(tokenizer.eos_token_ids)


def test_each_candidate_gets_a_matcher_of_its_own(compiler, tokenizer) -> None:
    masks = masks_of(compiler, Constraint("regex", "[0-9]+x"))
    first, second = masks(), masks()
    for token_id in tokenizer.encode("12x", add_special_tokens=False):
        first.accept(token_id)
    vocab = tokenizer.vocab_size
    assert allowed_ids(first, vocab) == sorted(tokenizer.eos_token_ids)
    digits_first = allowed_ids(second, vocab)
    assert all(tokenizer.decode([t]).isdigit() for t in digits_first)


def test_a_schema_mask_admits_a_valid_document_token_by_token(compiler, tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    }
    mask = masks_of(compiler, Constraint("json_schema", json.dumps(schema)))()
    for token_id in tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False):
        assert token_id in allowed_ids(mask, tokenizer.vocab_size)
        mask.accept(token_id)
    assert allowed_ids(mask, tokenizer.vocab_size) == sorted(tokenizer.eos_token_ids)


@pytest.mark.parametrize("num_masks", [1, 3, 40])
def test_a_steps_masks_fill_their_rows_and_leave_the_others_all_ones(
    compiler, tokenizer, num_masks
) -> None:
    """start_filling gives each masked row what its own mask allows, at each mask's place in
    its text; the rows between stay all ones."""
    masks = masks_of(compiler, Constraint("regex", "[0-9]+x|ab+c"))
    texts = ["12", "ab", "", "1x", "abbb"]
    placed = []
    for i in range(num_masks):
        mask = masks()
        for token_id in tokenizer.encode(texts[i % len(texts)], add_special_tokens=False):
            mask.accept(token_id)
        placed.append((2 * i, mask))  # every other row masked
    vocab = tokenizer.vocab_size
    allowed = start_filling(placed, 2 * num_masks, vocab).result()
    for row, mask in placed:
        bits = np.unpackbits(allowed[row].view(np.uint8), bitorder="little")[:vocab]
        assert np.flatnonzero(bits).tolist() == allowed_ids(mask, vocab)
        assert (allowed[row + 1] == -1).all()


def test_start_filling_returns_while_the_masks_fill_and_they_fill_right(
    compiler, tokenizer
) -> None:
    """The caller goes on while llguidance fills (the engine thread queues the forward and
    makes events meanwhile): start_filling is back before a fill of thousands of rows inside
    a free string, which takes tens of milliseconds here, is done; each row ends up what
    its own matcher allows."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    masks = masks_of(compiler, Constraint("json_schema", json.dumps(schema)))
    opening = tokenizer.encode('{"note": "', add_special_tokens=False)
    placed = []
    for row in range(2000):
        mask = masks()
        for token_id in opening:
            mask.accept(token_id)
        placed.append((row, mask))
    fill = start_filling(placed, len(placed), tokenizer.vocab_size)
    assert fill.filling is not None and fill.filling.locked()  # still filling
    allowed = fill.result()
    for row in (0, 999, 1999):
        bits = np.unpackbits(allowed[row].view(np.uint8), bitorder="little")
        assert np.flatnonzero(bits[: tokenizer.vocab_size]).tolist() == allowed_ids(
            placed[row][1], tokenizer.vocab_size
        )
    assert len(allowed_ids(placed[0][1], tokenizer.vocab_size)) > 1000  # inside the string


def test_a_forked_child_fills_masks_on_threads_of_its_own(compiler, tokenizer) -> None:
    """A child forked after the parent filled masks (its filling thread and llguidance's
    exist) fills its own instead of waiting forever for threads it does not have."""
    masks = masks_of(compiler, Constraint("regex", "[0-9]+"))
    placed = [(0, masks())]
    parent = start_filling(placed, 1, tokenizer.vocab_size).result()
    pid = os.fork()
    if pid == 0:  # the child: a hang is cut off by the alarm and counts as a failure
        signal.alarm(20)
        try:
            child = start_filling(placed, 1, tokenizer.vocab_size).result()
            os._exit(0 if np.array_equal(child, parent) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_grammar_fill_that_raises_reaches_the_caller(compiler, tokenizer) -> None:
    """A fault on the filling thread is the future's, not a lost thread's: the next
    fill still runs."""
    masks = masks_of(compiler, Constraint("regex", "[0-9]+"))
    with pytest.raises(ValueError, match="out of bounds"):
        start_filling([(1, masks())], 1, tokenizer.vocab_size).result()  # row 1 of 1
    allowed = start_filling([(0, masks())], 1, tokenizer.vocab_size).result()
    assert np.flatnonzero(np.unpackbits(allowed[0].view(np.uint8), bitorder="little")).size


def test_a_grammar_its_parser_gives_up_on_fails_by_its_field_without_its_state(
    compiler, tokenizer
) -> None:
    """5,001 alternatives compile; the parser's row of items is past its limit once a token
    is taken. The mask says so in one line naming the field, not with the parser's state
    (which quotes the grammar and the tokens)."""
    wide = "start: " + " | ".join(f'"a{i}"' for i in range(5001))
    mask = masks_of(compiler, Constraint("grammar", wide, field="structured_outputs.grammar"))()
    (token_id,) = mask.forced()
    with pytest.raises(ValidationError) as caught:
        mask.accept(token_id)
    assert caught.value.field == "structured_outputs.grammar"
    assert str(caught.value) == (
        "structured_outputs.grammar: the grammar's parser gave up after 1 tokens (Current row "
        "has 5002 items; max is 2000; consider making your grammar left-recursive if it's "
        "right-recursive); simplify it"
    )


def test_a_fill_that_stops_its_matcher_is_found_at_the_token_after_it(
    tokenizer, monkeypatch
) -> None:
    """A fill past the parser's items limit stops the matcher and leaves its row allowing
    EOS alone, and a stopped matcher takes EOS as if it were fine: accepting it fails,
    naming the field and the limit."""
    monkeypatch.setattr(
        grammar, "_LIMITS", LLParserLimits(verbose_errors=False, step_max_items=300)
    )
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    mask = masks_of(compiler, Constraint("grammar", AMBIGUOUS, field="grammar"))()
    (ab,) = tokenizer.encode("ab", add_special_tokens=False)
    while True:  # a few tokens in
        allowed = start_filling([(0, mask)], 1, tokenizer.vocab_size).result()
        if mask.matcher.is_error():
            break
        mask.accept(ab)
    bits = np.unpackbits(allowed[0].view(np.uint8), bitorder="little")[: tokenizer.vocab_size]
    assert np.flatnonzero(bits).tolist() == list(tokenizer.eos_token_ids)
    with pytest.raises(ValidationError) as caught:
        mask.accept(tokenizer.eos_token_ids[0])
    assert str(caught.value).startswith("grammar: the grammar's parser gave up after ")
    assert "(Too many items (limit 300; mask)" in str(caught.value)


def test_the_slow_mask_of_a_fill_that_overran_is_found_by_filling_each_alone_next_time(
    tokenizer,
) -> None:
    """A step's grammar masks fill together on llguidance's threads, timed as one on the
    clock. Where that overran the step limit, a position's mask once computed being kept,
    the next fill takes each of them alone, its CPU time read: an ambiguous grammar's (over
    0.1 s, 100 tokens in) fails by its field, a regex's beside it (microseconds) goes on,
    and fills together again. A mask alone in a fill that overran is found the same way."""
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, step_time_limit=0.03
    )
    ambiguous = Constraint("grammar", AMBIGUOUS, field="grammar")
    slow, fast = (
        masks_of(compiler, ambiguous)(),
        masks_of(compiler, Constraint("regex", "[0-9]+"))(),
    )
    (ab,) = tokenizer.encode("ab", add_special_tokens=False)
    (seven,) = tokenizer.encode("7", add_special_tokens=False)
    for _ in range(100):  # its matcher moved on untimed: taking a token costs it time too
        slow.matcher.consume_token(ab)

    def fill(*masks) -> dict:
        filled = start_filling(list(enumerate(masks)), len(masks), tokenizer.vocab_size)
        filled.result()
        return filled.failures()

    assert fill(slow, fast) == {}  # which of them overran, a fill of both cannot tell
    assert slow.fill_alone and fast.fill_alone
    slow.matcher.consume_token(ab)
    fast.accept(seven)
    failures = fill(slow, fast)
    assert list(failures) == [0] and failures[0].field == "grammar"
    assert "past the limit of 0.03 s a token; simplify it" in str(failures[0])
    assert not slow.fill_alone and not fast.fill_alone
    fast.accept(seven)
    assert fill(fast) == {} and not fast.fill_alone
    for _ in range(2):
        slow.matcher.consume_token(ab)
        failures = fill(slow)
    assert list(failures) == [0]


def test_taking_a_token_past_the_limit_fails_once_its_cpu_time_says_so(tokenizer) -> None:
    """A call that moves a mask on and overran the limit on the clock (which a busy machine
    stretches) has the next one's CPU time read; that one past the limit fails."""
    compiler = GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, step_time_limit=0.005
    )
    mask = masks_of(compiler, Constraint("grammar", AMBIGUOUS, field="grammar"))()
    (ab,) = tokenizer.encode("ab", add_special_tokens=False)
    for _ in range(100):  # taking a token now costs it over 0.02 s
        mask.matcher.consume_token(ab)
    mask.accept(ab)
    assert mask.cpu_timed
    with pytest.raises(ValidationError, match="past the limit of 0.005 s a token") as caught:
        mask.accept(ab)
    assert caught.value.field == "grammar"


def test_a_model_whose_tokenizer_llguidance_cannot_read_refuses_every_constraint(
    tokenizer, caplog
) -> None:
    no_decoder = Tokenizer(
        BackendTokenizer.from_str(_without_decoder(tokenizer.backend.to_str())),
        vocab_size=tokenizer.vocab_size,
        bos_token_id=None,
        eos_token_ids=tokenizer.eos_token_ids,
        add_bos=False,
        special_tokens={},
        chat_template=None,
    )
    compiler = GrammarCompiler(no_decoder, no_decoder.vocab_size, no_decoder.eos_token_ids)
    assert compiler.unavailable is not None
    with pytest.raises(ValidationError) as caught:
        compiler.compile(Constraint("regex", "[0-9]+", field="regex"))
    assert str(caught.value).startswith(
        "regex: structured output is not available for this model: its tokenizer has no decoder"
    )
    assert [r.levelname for r in caplog.records if "not available" in r.message] == ["WARNING"]


def _without_decoder(tokenizer_json: str) -> str:
    tokenizer = json.loads(tokenizer_json)
    tokenizer["decoder"] = None
    return json.dumps(tokenizer)


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("min_tokens", 2)])
def test_what_would_hold_eos_back_past_a_constraint_is_refused(field, value) -> None:
    params = SamplingParams(constraint=Constraint("json_object"), **{field: value})
    with pytest.raises(ValidationError) as caught:
        params.validate()
    assert caught.value.field == field
