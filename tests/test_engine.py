"""The engine end to end on tiny random-weight models: scheduling, caching, sampling, endings.

Every test runs twice: with each step run start to end, and with async scheduling (the
next step queued before the last one's tokens are read back), which must not change a
single output."""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from engine.errors import ValidationError
from engine.llm import LLM
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder
from engine.sampling_params import SamplingParams
from tests.invariants import check_invariants
from tests.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_llama, async_scheduling):
    return LLM(str(tiny_llama), num_blocks=256, block_size=4, async_scheduling=async_scheduling)


def random_prompts(count: int, vocab: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def assert_pool_empty(llm: LLM) -> None:
    bm = llm.engine.block_manager
    check_invariants(bm)
    assert bm.num_used_blocks == 0
    assert not llm.engine.requests
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_greedy_matches_transformers(tiny_llama, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    for prompt in random_prompts(3, vocab, seed=1, lo=5, hi=30):
        ours = llm.generate([prompt], SamplingParams(max_tokens=32, **GREEDY))[0]
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32
            )[0, len(prompt) :].tolist()
        assert ours.outputs[0].token_ids == ref
    assert_pool_empty(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_batch_invariance_with_chunking_prefix_caching_and_preemption(
    tiny_llama, async_scheduling, kv_cache_dtype
):
    solo = LLM(
        str(tiny_llama),
        num_blocks=512,
        block_size=4,
        async_scheduling=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    vocab = solo.engine.model_config.vocab_size
    shared = random_prompts(1, vocab, seed=5, lo=20, hi=20)[0]
    prompts = random_prompts(16, vocab, seed=2, lo=3, hi=60)
    prompts = [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts)]  # prefix hits
    params = [SamplingParams(max_tokens=8 + 3 * i, **GREEDY) for i in range(16)]
    expected = [solo.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]

    # A pool of 48 blocks of 4 tokens cannot hold 16 sequences of up to ~130 tokens at once,
    # and a budget of 24 tokens chunks every long prompt.
    pressured = LLM(
        str(tiny_llama),
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert pressured.engine.runner.kv_caches[0].dtype == solo.engine.runner.kv_dtype
    got = [o.outputs[0].token_ids for o in pressured.generate(prompts, params)]
    assert got == expected
    engine = pressured.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.hit_tokens > 0
    assert_pool_empty(pressured)


def test_seeded_sampling_ignores_batch_mates(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=9)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = random_prompts(7, vocab, seed=10)
    mixed = llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
        + [params]
        + [SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)] * 4,
    )
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_candidates_share_prompt_blocks(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=11, lo=10, hi=10)[0]  # 10 tokens: a partial last block
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(
        len(o.token_ids) == 12 and o.finish_reason is FinishReason.LENGTH for o in out.outputs
    )
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    single = llm.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1}))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids
    greedy = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, **GREEDY))[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    assert out.usage.completion_tokens == 48
    assert_pool_empty(llm)


def test_generate_keeps_outputs_not_events(llm, monkeypatch):
    """generate() folds each event into its request's output as it comes: at most one event
    (its loop variable's) outlives the step after it; holding them all kept ~270k objects
    alive in a large offline batch, for Python's collector to walk. The outputs are whole
    all the same."""
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(2, vocab, seed=14)
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, logprobs=2)
    events: list[weakref.ref] = []
    alive_a_step_later = []
    step = llm.engine.step

    def watched_step():
        alive_a_step_later.append(sum(ref() is not None for ref in events))
        new = step()
        events.extend(weakref.ref(e) for e in new)
        return new

    monkeypatch.setattr(llm.engine, "step", watched_step)
    outs = llm.generate(prompts, params)
    assert len(events) > 10
    assert max(alive_a_step_later) <= 1
    for out in outs:
        assert [len(o.token_ids) for o in out.outputs] == [10, 10]
        assert all(len(o.logprobs) == 10 for o in out.outputs)
        text = llm.tokenizer.decode(out.outputs[1].token_ids)
        assert out.outputs[1].text == text
    assert outs[0].usage.completion_tokens == 20


def test_stop_string_trims_and_reports(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=12)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    first = full.text.index(stop)
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0].outputs[0]
    assert cut.finish_reason is FinishReason.STOP and cut.matched_stop == stop
    assert cut.text == full.text[:first]
    kept = llm.generate(
        [prompt],
        SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True, **GREEDY),
    )[0].outputs[0]
    assert kept.text == full.text[: first + len(stop)]


def test_stop_token_ids_min_tokens_and_eos(llm):
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=13)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], **GREEDY))
    o = out[0].outputs[0]
    assert o.finish_reason is FinishReason.STOP and o.matched_stop == stop_id
    assert o.token_ids == full.token_ids[: first + 1]

    # EOS is the greedy choice at step k: with min_tokens above k it is banned instead.
    eos = next(iter(llm.engine.eos_token_ids))
    forced = SamplingParams(
        max_tokens=20, temperature=0.0, stop_token_ids=[stop_id], min_tokens=first + 3
    )
    o = llm.generate([prompt], forced)[0].outputs[0]
    assert len(o.token_ids) >= first + 3 and stop_id not in o.token_ids[: first + 2]
    assert eos not in o.token_ids[:-1]


def test_prompt_and_sample_logprobs_match_transformers(tiny_llama, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=14, lo=30, hi=30)[0]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=3, logprobs=5, prompt_logprobs=3, **GREEDY)
    )[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(3).indices.tolist()
    first = out.outputs[0].logprobs[0]
    assert first.token_id == out.outputs[0].token_ids[0] == ref[-1].argmax().item()
    assert abs(first.logprob - ref[-1].max().item()) < 1e-4
    assert len(first.top) == 5 and first.top[0][0] == first.token_id


def test_cancel_mid_decode_returns_every_block(llm):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(random_prompts(4, vocab, seed=15)):
        engine.add_request(f"c{i}", prompt, SamplingParams(n=2, max_tokens=50, **GREEDY))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    events = engine.abort_request("c1")
    assert {e.index for e in events} == {0, 1}
    assert all(e.finish_reason is FinishReason.CANCELLED and e.usage is not None for e in events)
    assert engine.abort_request("c1") == []  # idempotent
    for rid in ("c0", "c2", "c3"):
        engine.abort_request(rid)
    assert_pool_empty(llm)


def test_cancel_while_waiting_and_before_fork(llm):
    engine = llm.engine
    engine.add_request("w", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=5, **GREEDY))
    events = engine.abort_request("w")
    assert sorted(e.index for e in events) == [0, 1, 2]
    assert_pool_empty(llm)


def test_engine_fault_fails_only_that_step(llm, monkeypatch):
    engine = llm.engine
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=10, **GREEDY))
    engine.step()
    events = engine.step()
    assert [e.finish_reason for e in events] == [FinishReason.ERROR]
    assert "injected fault" in events[0].error
    assert_pool_empty(llm)
    again = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert len(again.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt_token_ids=[]), "prompt"),
        (dict(prompt_token_ids=[1, -3]), "prompt_token_ids"),
        (dict(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, True]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, 2.0]), "prompt_token_ids"),
        (dict(prompt_token_ids=[1] * 2000), "prompt"),
        (dict(prompt_token_ids=[1, 2], max_tokens=5000), "max_tokens"),
        (dict(prompt_token_ids=[1, 2], temperature=-1.0), "temperature"),
    ],
)
def test_invalid_requests_fail_alone(llm, kwargs, field):
    kwargs = dict(kwargs)  # the parameter dict is shared by both modes' runs
    ids = kwargs.pop("prompt_token_ids")
    with pytest.raises(ValidationError) as err:
        llm.generate([ids], SamplingParams(**kwargs))
    assert err.value.field == field
    assert_pool_empty(llm)


def test_a_bad_prompt_in_a_batch_admits_none_of_it(llm):
    good = [SamplingParams(max_tokens=4, **GREEDY)] * 2
    with pytest.raises(ValidationError, match="token 1 is -3"):
        llm.generate([[1, 2, 3], [4, -3]], good)
    assert_pool_empty(llm)  # the good prompt before the bad one was taken back
    (out,) = llm.generate([[1, 2, 3]], good[0])  # and the next batch does not see it
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_empty(llm)


def test_a_bad_token_id_is_named_by_its_index(llm):
    with pytest.raises(ValidationError, match=r"token 2 is True, expected an integer in \[0, "):
        llm.engine.add_request("bad", [5, 7, True, -1], SamplingParams(max_tokens=4))
    with pytest.raises(ValidationError, match="token 3 is -1"):
        llm.engine.add_request("bad", [5, 7, 1, -1], SamplingParams(max_tokens=4))
    assert "bad" not in llm.engine.requests


def test_request_larger_than_pool_is_rejected_with_pool_named(tiny_llama, async_scheduling):
    # 32 tokens in the whole pool
    small = LLM(str(tiny_llama), num_blocks=8, block_size=4, async_scheduling=async_scheduling)
    with pytest.raises(ValidationError, match="KV pool 32"):
        small.generate([[1] * 20], SamplingParams(max_tokens=20))
    out = small.generate([[1] * 20], SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 10


def test_duplicate_live_request_id(llm):
    llm.engine.add_request("dup", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValidationError) as err:
        llm.engine.add_request("dup", [3, 4], SamplingParams(max_tokens=4))
    assert err.value.field == "request_id"
    llm.engine.abort_request("dup")
    assert_pool_empty(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_tracks_float32(tiny_llama, llm, async_scheduling, dtype):
    half = LLM(
        str(tiny_llama),
        num_blocks=64,
        block_size=4,
        dtype=dtype,
        async_scheduling=async_scheduling,
    )
    assert half.engine.runner.kv_caches[0].dtype == getattr(torch, dtype)
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=16, lo=24, hi=24)[0]
    params = SamplingParams(max_tokens=1, logprobs=5, prompt_logprobs=0, **GREEDY)
    ref = llm.generate([prompt], params)[0]
    got = half.generate([prompt], params)[0]
    ref_lp = torch.tensor([p.logprob for p in ref.prompt_logprobs[1:]])
    got_lp = torch.tensor([p.logprob for p in got.prompt_logprobs[1:]])
    assert ((got_lp - ref_lp).norm() / ref_lp.norm()).item() < 2e-2
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_pool_empty(half)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_llama, llm, async_scheduling):
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(1, vocab, seed=17, lo=30, hi=30)[0]
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)
    expected = llm.generate([prompt], params)[0].prompt_logprobs

    # 10 blocks of 4 tokens: the high-priority request grows towards 10 blocks while the
    # prompt-logprobs one (8 blocks, prefilled 3 tokens a step) must give way mid-prefill.
    small = LLM(
        str(tiny_llama),
        num_blocks=10,
        block_size=4,
        max_num_batched_tokens=4,
        async_scheduling=async_scheduling,
    )
    engine = small.engine
    engine.add_request("hi", prompt[:8], SamplingParams(max_tokens=30, **GREEDY), priority=1)
    engine.step()
    engine.add_request("lp", prompt, params)
    events = []
    while engine.has_unfinished_requests:
        events.extend(engine.step())
    assert engine.scheduler.num_preemptions > 0
    got = next(e.prompt_logprobs for e in events if e.request_id == "lp" and e.prompt_logprobs)
    assert len(got) == len(prompt) == len(expected)
    assert [(p.token_id, round(p.logprob, 4)) for p in got[1:]] == [
        (p.token_id, round(p.logprob, 4)) for p in expected[1:]
    ]
    assert_pool_empty(small)


def logprob_rows(logprobs) -> list[float]:  # noqa: ANN001
    """Chosen and top logprobs, flat."""
    return [v for lp in logprobs or [] for v in (lp.logprob, *(x for _, x in lp.top))]


def test_async_scheduling_changes_no_output(tiny_llama, monkeypatch):
    """Every sampling feature at once, under block pressure: the same outputs either way,
    and the async engine really computes tokens the host has not read back yet. Logprobs
    agree to float32 rounding: running ahead, a step also computes rows of sequences that
    just finished, and the CPU's matrix products round a row by the batch's row count."""
    sync = LLM(str(tiny_llama), num_blocks=40, block_size=4, async_scheduling=False)
    overlapped = LLM(str(tiny_llama), num_blocks=40, block_size=4, async_scheduling=True)
    vocab = sync.engine.model_config.vocab_size
    prompts = random_prompts(12, vocab, seed=21, lo=5, hi=30)
    sampled = dict(temperature=0.9, top_k=20, ignore_eos=True)
    params = [SamplingParams(max_tokens=20, seed=i, **sampled) for i in range(4)] + [
        SamplingParams(max_tokens=16, n=3, seed=5, **sampled),
        SamplingParams(max_tokens=16, seed=6, repetition_penalty=1.3, **sampled),
        SamplingParams(
            max_tokens=16, seed=7, frequency_penalty=0.8, presence_penalty=0.4, **sampled
        ),
        SamplingParams(max_tokens=16, logprobs=3, prompt_logprobs=2, **GREEDY),
        SamplingParams(max_tokens=24, min_tokens=6, seed=8, temperature=1.0),
        SamplingParams(max_tokens=24, stop=["a", "e"], seed=9, temperature=1.0),
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(max_tokens=30, seed=11, temperature=0.5),
    ]
    device_only = []  # per step: sequences whose input token the host has not read yet
    forward = overlapped.engine.runner.forward

    def spy(plan):
        slots = set(plan.slots.tolist())
        running = overlapped.engine.scheduler.running
        device_only.append(
            sum(s.slot in slots and len(s.token_ids) < s.num_tokens for s in running)
        )
        return forward(plan)

    monkeypatch.setattr(overlapped.engine.runner, "forward", spy)
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert sum(device_only) > len(device_only)  # most steps read their tokens on the device
    assert overlapped.engine.scheduler.num_preemptions > 0
    for want, have in zip(expected, got, strict=True):
        assert have.prompt_logprobs == want.prompt_logprobs
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in b.logprobs or []] == [
                (lp.token_id, [t for t, _ in lp.top]) for lp in a.logprobs or []
            ]
            assert logprob_rows(b.logprobs) == pytest.approx(logprob_rows(a.logprobs), abs=1e-5)
        assert have.usage == want.usage
    assert_pool_empty(overlapped)


def test_a_request_is_finished_once_every_candidate_is():
    builder = RequestOutputBuilder.start("r", [1, 2], n=2)
    builder.add(CandidateEvent("r", 0, "a", [5]))
    builder.add(CandidateEvent("r", 1, "b", [6], finish_reason=FinishReason.LENGTH))
    assert not builder.finished
    builder.add(CandidateEvent("r", 0, "c", [7], finish_reason=FinishReason.STOP))
    assert builder.finished
    built = builder.build()
    assert [o.text for o in built.outputs] == ["ac", "b"]
    assert [o.token_ids for o in built.outputs] == [[5, 7], [6]]


def test_the_progress_bar_counts_each_request_once(llm, capsys):
    params = [SamplingParams(max_tokens=3, n=2, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)]
    llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=True)
    bar = capsys.readouterr().err
    assert "2/2" in bar and "3/2" not in bar  # the two-candidate request counts once
