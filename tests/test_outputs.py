"""RequestOutputBuilder: a request's events gathered into the answer every door formats."""

from __future__ import annotations

from engine.outputs import (
    CandidateEvent,
    FinishReason,
    RequestOutputBuilder,
    RequestTiming,
    TokenLogprob,
    Usage,
)


def test_candidates_usage_logprobs_and_timing_are_gathered():
    builder = RequestOutputBuilder.start("r", (1, 2, 3), n=2)
    first, second = TokenLogprob(5, -0.5), TokenLogprob(7, -0.25, [(7, -0.25), (8, -2.0)])
    prompt_logprobs = [None, TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]
    timing = RequestTiming(arrival=1.0, first_scheduled=1.5, first_token=2.0, finished=3.0)
    builder.add(CandidateEvent("r", 0, "He", [5], [first], prompt_logprobs=prompt_logprobs))
    builder.add(CandidateEvent("r", 1, "x", [9]))
    assert builder.texts_so_far() == ["He", "x"] and not builder.finished
    builder.add(
        CandidateEvent("r", 1, "", [], finish_reason=FinishReason.CANCELLED, usage=Usage(3, 1, 2))
    )
    builder.add(
        CandidateEvent(
            "r",
            0,
            "y!",
            [7],
            [second],
            finish_reason=FinishReason.STOP,
            matched_stop="!",
            usage=Usage(3, 2, 1),
            timing=timing,
        )
    )
    assert builder.finished
    output = builder.build()
    assert (output.request_id, output.prompt_token_ids) == ("r", [1, 2, 3])
    assert output.prompt_logprobs == prompt_logprobs
    a, b = output.outputs
    assert (a.text, a.token_ids, a.logprobs) == ("Hey!", [5, 7], [first, second])
    assert (a.finish_reason, a.matched_stop) == (FinishReason.STOP, "!")
    assert (b.text, b.token_ids, b.logprobs, b.finish_reason) == (
        "x",
        [9],
        None,
        FinishReason.CANCELLED,
    )
    # Output tokens add up over the candidates; cache hits are the prompt's, counted once.
    assert output.usage == Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=2)
    assert output.timing is timing
