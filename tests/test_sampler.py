"""The batched sampler: filters, penalties, bans, the exponential race, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.sampler import (
    Sampler,
    SamplerOutput,
    _penalise_and_ban,
    prompt_logprobs,
)
from engine.kernels.race import exponential_noise
from engine.sampling_params import SamplingParams
from tests.sampling import sampling_tensors

sampler = Sampler()


def run(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    banned_ids: Sequence[Sequence[int]] | None = None,
) -> SamplerOutput:
    rows = len(params)
    tensors = sampling_tensors(
        params,
        seeds=seeds if seeds is not None else list(range(rows)),
        prompt_ids=prompt_ids if prompt_ids is not None else [[]] * rows,
        output_ids=output_ids if output_ids is not None else [[]] * rows,
        banned_ids=banned_ids if banned_ids is not None else [[]] * rows,
        vocab_size=logits.shape[1],
        device="cpu",
    )
    return sampler(logits, tensors)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """`draws` samples of one row, each from a distinct seed."""
    logits = logits_row[None, :].expand(draws, -1).contiguous()
    return run(logits, [params] * draws, seeds=list(range(draws))).token_ids


def chi_square(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# --- greedy and filters -------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    out = run(logits, [SamplingParams(temperature=0.0)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_greedy_rows_ignore_filters_and_batch_mates() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0, top_p=0.01, min_p=1.0, top_k=3)
        if i % 2
        else SamplingParams()
        for i in range(8)
    ]
    out = run(logits, params)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(dim=-1))


def test_greedy_ties_go_to_the_first_index_on_every_path() -> None:
    logits = torch.zeros(4, 50)
    logits[:, [3, 20, 41]] = 1.0
    greedy = SamplingParams(temperature=0.0)
    batches = {
        "fast": SamplingParams(temperature=0.8),
        "filtered": SamplingParams(top_k=5, top_p=0.9),
        "penalised": SamplingParams(presence_penalty=0.5),
    }
    for name, sampled in batches.items():
        out = run(logits, [greedy, sampled, greedy, sampled], output_ids=[[], [], [], [1]])
        assert out.token_ids[0::2].tolist() == [3, 3], name


def test_mixed_batch_draws_what_the_race_defines() -> None:
    """Without penalties or filters: greedy rows take the argmax, sampled rows the argmax of
    softmax(logits / temperature) / E with E the rows' counter-based noise."""
    generator = torch.Generator().manual_seed(9)
    rows, vocab = 12, 500
    logits = torch.randn(rows, vocab, generator=generator) * 2
    temperatures = [0.0, 0.5, 1.0, 1.7] * 3
    seeds = torch.randint(2**40, (rows,), generator=generator).tolist()
    outputs = [[1] * i for i in range(rows)]  # counters 0 .. rows - 1
    out = run(logits, [SamplingParams(temperature=t) for t in temperatures], seeds, None, outputs)
    noise = exponential_noise(torch.tensor(seeds), torch.arange(rows), vocab)
    for i, t in enumerate(temperatures):
        want = logits[i].argmax() if t == 0 else ((logits[i] / t).softmax(-1) / noise[i]).argmax()
        assert out.token_ids[i] == want, i


@pytest.mark.parametrize("trial", range(3))
def test_logits_in_the_model_dtype_sample_like_their_float32_values(trial: int) -> None:
    generator = torch.Generator().manual_seed(200 + trial)
    rows, vocab = 16, 300
    logits = (torch.randn(rows, vocab, generator=generator) * 2).to(torch.bfloat16)
    params = [random_row_params(generator) for _ in range(rows)]
    outputs = [torch.randint(vocab, (3,), generator=generator).tolist() for _ in range(rows)]
    got = run(logits, params, output_ids=outputs, banned_ids=[[0]] * rows)
    want = run(logits.float(), params, output_ids=outputs, banned_ids=[[0]] * rows)
    assert torch.equal(got.token_ids, want.token_ids)
    for name in ("logprobs", "top_token_ids", "top_logprobs"):
        got_value, want_value = getattr(got, name), getattr(want, name)
        assert (got_value is None) == (want_value is None), name
        assert got_value is None or torch.equal(got_value, want_value), name


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(2)) * 0.1
    out = run(logits, [SamplingParams(top_k=1, temperature=1.5)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def allowed_tokens(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """A plain reference for top-k -> top-p -> min-p, lenient by 1e-5 at the edges."""
    scaled = row.double() / p.temperature
    order = sorted(range(len(row)), key=lambda v: -float(scaled[v]))
    if 0 < p.top_k < len(order):
        order = order[: p.top_k]
    weights = [math.exp(float(scaled[v]) - float(scaled[order[0]])) for v in order]
    probs = [w / sum(weights) for w in weights]
    kept, mass = set(), 0.0
    for v, prob in zip(order, probs, strict=True):
        if mass < p.top_p + 1e-5 and prob >= p.min_p * probs[0] - 1e-5:
            kept.add(v)
        mass += prob
    return kept


@settings(max_examples=40, deadline=None)
@given(
    logits_seed=st.integers(0, 2**31),
    vocab=st.integers(2, 60),
    temperature=st.floats(0.1, 3.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 20]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_pick_a_filtered_token(
    logits_seed: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(logits_seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    picked = set(draw_many(row, params, draws=64).tolist())
    assert picked <= allowed_tokens(row, params)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log()
    assert set(draw_many(row, SamplingParams(top_p=0.5), 500).tolist()) == {0}
    assert set(draw_many(row, SamplingParams(top_p=0.75), 500).tolist()) == {0, 1}
    assert set(draw_many(row, SamplingParams(top_p=0.85), 2000).tolist()) == {0, 1, 2}


def test_min_p_is_relative_to_the_top_token() -> None:
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draw_many(row, SamplingParams(min_p=0.5), 2000).tolist()) == {0, 1}
    assert set(draw_many(row, SamplingParams(min_p=0.2), 2000).tolist()) == {0, 1, 2}


# --- the exponential race samples the right distribution ----------------------------------

# Chi-square with 4 degrees of freedom exceeds 25 with probability ~5e-5.
CHI2_BOUND_DF4 = 25.0
LOGITS_5 = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_race_matches_softmax_across_seeds(temperature: float) -> None:
    tokens = draw_many(LOGITS_5, SamplingParams(temperature=temperature), draws=20_000)
    assert chi_square(tokens, (LOGITS_5 / temperature).softmax(-1)) < CHI2_BOUND_DF4


def test_race_matches_softmax_across_steps_of_one_seed() -> None:
    draws = 20_000
    logits = LOGITS_5[None, :].expand(draws, -1).contiguous()
    tensors = sampling_tensors(
        [SamplingParams()] * draws,
        [1234] * draws,
        [[]] * draws,
        [[]] * draws,
        [[]] * draws,
        5,
        "cpu",
    )
    tensors.counters = torch.arange(draws)  # step k of the same sequence
    tokens = sampler(logits, tensors).token_ids
    assert chi_square(tokens, LOGITS_5.softmax(-1)) < CHI2_BOUND_DF4


def test_race_renormalises_after_top_k() -> None:
    tokens = draw_many(LOGITS_5, SamplingParams(top_k=3), draws=20_000)
    expected = torch.zeros(5)
    expected[:3] = LOGITS_5[:3].softmax(-1)
    assert set(tokens.tolist()) == {0, 1, 2}
    observed = torch.bincount(tokens, minlength=5)[:3].double()
    statistic = float(((observed - expected[:3] * 20_000) ** 2 / (expected[:3] * 20_000)).sum())
    assert statistic < 20.0  # 2 degrees of freedom: p ~ 5e-5


def test_noise_is_exponential_and_uncorrelated() -> None:
    noise = exponential_noise(torch.tensor([0, -7, 2**62]), torch.tensor([0, 3, 9]), 50_000)
    uniform = torch.exp(-noise)
    assert torch.all((uniform > 0) & (uniform < 1))
    assert torch.allclose(noise.mean(dim=1), torch.ones(3), atol=0.02)
    neighbours = torch.corrcoef(torch.stack([uniform[0, :-1], uniform[0, 1:]]))[0, 1]
    rows = torch.corrcoef(uniform)
    assert abs(float(neighbours)) < 0.02
    assert rows.triu(1).abs().max() < 0.02


# --- penalties and bans -------------------------------------------------------------------


def reference_penalties(
    row: list[float], p: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    result = list(row)
    for v in set(prompt) | set(output):
        r = p.repetition_penalty
        result[v] = result[v] / r if result[v] > 0 else result[v] * r
    for v in set(output):
        result[v] -= p.frequency_penalty * output.count(v) + p.presence_penalty
    return result


def test_penalty_math_matches_reference() -> None:
    vocab = 12
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[0, 1, 2, 2], [3, 4], [5, 0, 11], [1, 2, 3]]
    outputs = [[6, 6, 1], [4, 4, 4, 7], [8, 5, 5, 9], [1, 1]]
    tensors = sampling_tensors(params, [0] * 4, prompts, outputs, [[]] * 4, vocab, "cpu")
    got = _penalise_and_ban(logits, tensors)  # the penalty rows' math, the rest untouched
    for i in range(4):
        expected = reference_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i])
        assert torch.allclose(got[i], torch.tensor(expected), atol=1e-6), i


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0], [3.0, 2.9, -1.0], [-0.5, -0.6, -5.0]])
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.2),  # 3.0 / 1.2 = 2.5 < 2.9
        SamplingParams(temperature=0, frequency_penalty=0.06),  # 3.0 - 2 * 0.06 < 2.9
        SamplingParams(temperature=0, repetition_penalty=1.5),  # negative: -0.5 * 1.5 < -0.6
    ]
    out = run(logits, params, prompt_ids=[[0], [], [0]], output_ids=[[], [0, 0], []])
    assert out.token_ids.tolist() == [1, 1, 1]


def test_unpenalised_rows_are_untouched_by_batch_mates_penalties() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), SamplingParams()]
    tensors = sampling_tensors(
        params, [0, 1], [[1, 2, 3], [1, 2, 3]], [[4], [4]], [[], []], 20, "cpu"
    )
    assert torch.equal(_penalise_and_ban(logits, tensors)[1], logits[1])


def test_banned_ids_are_never_picked() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(top_k=2),
    ]
    out = run(logits, params, banned_ids=[[0], [], [0, 1], [0]])
    assert out.token_ids.tolist()[:3] == [1, 0, 2]  # row 1 has no ban and keeps its argmax
    sampled = draw_many(logits[3], params[3], 1)  # sanity: unbanned, top-2 mostly picks 0
    assert sampled.item() in (0, 1)
    many = torch.tensor([[5.0, 4.0, 0.0, 0.0]]).expand(500, -1).contiguous()
    tensors = sampling_tensors(
        [SamplingParams(temperature=2.0)] * 500,
        range(500),
        [[]] * 500,
        [[]] * 500,
        [[0, 3]] * 500,
        4,
        "cpu",
    )
    assert set(sampler(many, tensors).token_ids.tolist()) == {1, 2}


# --- seeds: reproducible per row, whatever the batch ----------------------------------------


def random_row_params(generator: torch.Generator) -> SamplingParams:
    pick = lambda n: int(torch.randint(n, (1,), generator=generator))  # noqa: E731
    return SamplingParams(
        temperature=[0.0, 0.5, 1.0, 1.7][pick(4)],
        top_k=[-1, 1, 5, 40][pick(4)],
        top_p=[1.0, 0.9, 0.3][pick(3)],
        min_p=[0.0, 0.05, 0.3][pick(3)],
        repetition_penalty=[1.0, 1.3][pick(2)],
        presence_penalty=[0.0, 0.5][pick(2)],
        frequency_penalty=[0.0, -0.3][pick(2)],
        logprobs=[None, 0, 5][pick(3)],
    )


@pytest.mark.parametrize("trial", range(4))
def test_batch_invariance(trial: int) -> None:
    vocab = 300
    generator = torch.Generator().manual_seed(100 + trial)
    target = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, logprobs=0)
    target_logits = torch.randn(vocab, generator=generator)
    target_row = dict(seed=987_654 + trial, prompt=[1, 2, 3], output=[7, 8] * trial, banned=[0])

    def sample_in_batch(others: int, position: int) -> tuple[int, float]:
        params = [random_row_params(generator) for _ in range(others)]
        logits = [torch.randn(vocab, generator=generator) * 2 for _ in range(others)]
        seeds = [int(torch.randint(2**40, (1,), generator=generator)) for _ in range(others)]
        prompts = [torch.randint(vocab, (5,), generator=generator).tolist() for _ in range(others)]
        outputs = [
            torch.randint(vocab, (trial * 3,), generator=generator).tolist() for _ in range(others)
        ]
        banned = [[] for _ in range(others)]
        for column, value in [
            (params, target),
            (logits, target_logits),
            (seeds, target_row["seed"]),
            (prompts, target_row["prompt"]),
            (outputs, target_row["output"]),
            (banned, target_row["banned"]),
        ]:
            column.insert(position, value)
        out = run(torch.stack(logits), params, seeds, prompts, outputs, banned)
        return int(out.token_ids[position]), float(out.logprobs[position])

    alone = sample_in_batch(0, 0)
    assert sample_in_batch(15, 0) == alone
    assert sample_in_batch(15, 9) == alone
    assert sample_in_batch(15, 15) == alone
    assert sample_in_batch(3, 2) == alone


def test_same_seed_and_step_repeat_and_different_seeds_differ() -> None:
    vocab, steps = 1000, 64
    logits = torch.zeros(steps, vocab)  # uniform: every token equally likely

    def sequence(seed: int) -> list[int]:
        tensors = sampling_tensors(
            [SamplingParams()] * steps,
            [seed] * steps,
            [[]] * steps,
            [[]] * steps,
            [[]] * steps,
            vocab,
            "cpu",
        )
        tensors.counters = torch.arange(steps)
        return sampler(logits, tensors).token_ids.tolist()

    first = sequence(1)
    assert sequence(1) == first
    assert len(set(first)) > steps * 0.9  # steps of one seed are not stuck on one token
    for other_seed in (2, -1, 2**63 - 1, -(2**63), 1 + 2**32):
        other = sequence(other_seed)
        assert sum(a != b for a, b in zip(first, other, strict=True)) > steps * 0.9, other_seed


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SamplingParams(temperature=0.3, top_k=4, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(min_p=0.2, presence_penalty=1.0),
        SamplingParams(temperature=2.0, logprobs=0),
        SamplingParams(top_p=0.5, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    out = run(logits, params, prompt_ids=[[1, 2]] * 6, output_ids=[[3]] * 6, banned_ids=[[4]] * 6)
    reference = logits.double().log_softmax(dim=-1)
    chosen = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs.double(), chosen, atol=1e-5)
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == out.top_logprobs.shape == (6, 5)
    ref_values, ref_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, ref_ids)
    assert torch.allclose(out.top_logprobs.double(), ref_values, atol=1e-5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])


def test_chosen_logprob_ignores_the_penalty_that_shaped_the_choice() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0, logprobs=0),
        SamplingParams(temperature=0.05, frequency_penalty=0.5, logprobs=0),
    ]
    out = run(logits, params, prompt_ids=[[0], []], output_ids=[[0], [0, 0]])
    assert out.token_ids.tolist() == [0, 0]  # still the favourite after penalties
    raw = logits.log_softmax(dim=-1)[:, 0]
    assert torch.allclose(out.logprobs, raw, atol=1e-6)


def test_no_logprobs_unless_a_row_asks() -> None:
    logits = torch.randn(3, 10)
    out = run(logits, [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=2)])
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_no_top_logprobs_unless_requested() -> None:
    logits = torch.randn(3, 10)
    out = run(logits, [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=0)])
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (3,) and torch.all(out.logprobs <= 0)


@pytest.mark.parametrize("k", [0, 1, 7])
def test_prompt_logprobs(k: int) -> None:
    logits = torch.randn(9, 30, generator=torch.Generator().manual_seed(6)) * 2
    next_ids = torch.randint(30, (9,), generator=torch.Generator().manual_seed(7))
    chosen, top_ids, top_lps = prompt_logprobs(logits, next_ids, k)
    reference = logits.double().log_softmax(dim=-1)
    assert torch.allclose(chosen.double(), reference[torch.arange(9), next_ids], atol=1e-6)
    assert top_ids.shape == top_lps.shape == (9, k)
    ref_values, ref_ids = reference.topk(k, dim=-1)
    assert torch.equal(top_ids, ref_ids)
    assert torch.allclose(top_lps.double(), ref_values, atol=1e-6)


def test_prompt_logprobs_of_a_long_prompt_in_the_model_dtype() -> None:
    """More rows than one float32 pass takes: the same numbers as one pass over all of them."""
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(2500, 40, generator=generator) * 2).to(torch.bfloat16)
    next_ids = torch.randint(40, (2500,), generator=generator)
    chosen, top_ids, top_lps = prompt_logprobs(logits, next_ids, 3)
    reference = logits.float().log_softmax(dim=-1)
    assert torch.equal(chosen, reference[torch.arange(2500), next_ids])
    ref_values, ref_ids = reference.topk(3, dim=-1)
    assert torch.equal(top_ids, ref_ids) and torch.equal(top_lps, ref_values)


# --- on a GPU: same draws as the CPU, and no host sync inside the sampler ------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_cpu_without_host_sync() -> None:
    generator = torch.Generator().manual_seed(8)
    rows, vocab = 64, 1000
    params = [random_row_params(generator) for _ in range(rows)]
    logits = torch.randn(rows, vocab, generator=generator) * 2
    columns = dict(
        params=params,
        seeds=torch.randint(2**40, (rows,), generator=generator).tolist(),
        prompt_ids=[torch.randint(vocab, (6,), generator=generator).tolist() for _ in range(rows)],
        output_ids=[torch.randint(vocab, (4,), generator=generator).tolist() for _ in range(rows)],
        banned_ids=[[0, 1]] * rows,
        vocab_size=vocab,
    )
    on_cpu = sampler(logits, sampling_tensors(**columns, device="cpu"))
    gpu_tensors = sampling_tensors(**columns, device="cuda")
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = sampler(gpu_logits, gpu_tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on_gpu.token_ids.cpu(), on_cpu.token_ids)
    assert torch.allclose(on_gpu.logprobs.cpu(), on_cpu.logprobs, atol=1e-5)
    seeds, counters = gpu_tensors.seeds, gpu_tensors.counters
    gpu_noise = exponential_noise(seeds, counters, vocab).cpu()
    cpu_noise = exponential_noise(seeds.cpu(), counters.cpu(), vocab)
    assert torch.allclose(gpu_noise, cpu_noise, rtol=1e-6, atol=0)
