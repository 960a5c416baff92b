"""Warm-up: run every kernel path traffic can take once, before the engine says it is ready.

On a GPU the first use of a path builds its kernels: flashinfer compiles its eager decode
modules with nvcc (the CUDA-core one below TENSOR_CORE_MIN_BATCH decode rows, the
tensor-core one from there, both first planned by a step that mixes prefill and decode
rows), and Triton compiles a kernel per specialization (integer arguments equal to 1 or
divisible by 16 make variants of their own). Paid by the first callers, that is tens of
seconds of TTFT after readiness said SERVING. warm_up() builds synthetic requests from the
engine's own limits (max_num_seqs, max_num_batched_tokens, max_model_len, block size,
vocabulary) and runs them through add_request / step to completion:

  - prefill alone at 1, 2 and many tokens (the skinny-matmul rows, a step's whole token
    budget), a prompt longer than the budget (chunked prefill), a prompt behind a
    prefix-cache hit, and one whose only uncomputed token follows a hit;
  - mixed prefill + decode steps with few decode rows and, on flashinfer, with at least
    TENSOR_CORE_MIN_BATCH (as many as max_num_seqs and the budget allow);
  - a pure-decode step of every CUDA-graph batch size that traffic can reach;
  - the sampler's paths: greedy, the plain seeded race, top-k / top-p / min-p, penalties,
    min_tokens bans, logprobs with and without alternatives, prompt logprobs, n > 1
    (the later candidates start behind a prefix hit), stop strings and stop token ids, a
    structured-output token mask (where the model has structured output: the grammar
    compiler is built first, whether it has or not).

Then it leaves the engine as if fresh (LLMEngine.reset_state): no requests, no blocks
used, the prefix cache empty, every counter zero, so metrics count only real traffic.
On the CPU there is nothing to compile; the same requests run (the tensor-core row count
and the graph sizes are skipped, as the torch backend has neither), which costs a few
dozen steps of a few tokens each.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import random
import time
from dataclasses import dataclass, field

from engine.attention.flashinfer_backend import TENSOR_CORE_MIN_BATCH
from engine.core.engine import LLMEngine
from engine.errors import EngineError
from engine.outputs import FinishReason
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.structured.constraints import Constraint

log = logging.getLogger(__name__)

_ID_PREFIX = "pagedserve-warmup-"


class WarmupError(EngineError):
    """A warm-up request failed: the engine cannot serve what it was built for."""


@dataclass
class _Prompt:
    token_ids: list[int]
    params: SamplingParams


@dataclass
class WarmupReport:
    seconds: float = 0.0
    num_requests: int = 0
    num_steps: int = 0
    graph_batch_sizes: list[int] = field(default_factory=list)  # replayed, one step each
    decode_rows_mixed: list[int] = field(default_factory=list)  # decode rows of mixed steps


class _Plan:
    """The engine's limits, and prompts made from them."""

    def __init__(self, engine: LLMEngine, seed: int = 0):
        cfg = engine.config.scheduler
        self.engine = engine
        self.max_seqs = cfg.max_num_seqs
        self.budget = cfg.max_num_batched_tokens
        self.chunked = cfg.enable_chunked_prefill
        self.prefix_caching = engine.config.cache.enable_prefix_caching
        self.block_size = engine.block_manager.block_size
        self.max_len = engine.info.max_model_len
        self.vocab = engine.model_config.vocab_size
        self._rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self.vocab) for _ in range(n)]

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        return prompt_len >= 1 and prompt_len + max_tokens <= self.max_len


def greedy(max_tokens: int = 2, **more) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **more)


def sampler_variants(vocab: int, structured_output: bool = True) -> list[SamplingParams]:
    """One request per sampler path the batch's rows can take together (a token mask
    where the model has structured output)."""
    stop_ids = [1 % vocab, 2 % vocab]
    variants = [
        greedy(6, logprobs=MAX_LOGPROBS),  # top alternatives
        SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logprobs=0),
        SamplingParams(  # filters share one sort
            temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2, max_tokens=6, ignore_eos=True
        ),
        SamplingParams(  # penalties read the token history from the token table
            temperature=0.9,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            seed=3,
            max_tokens=6,
            ignore_eos=True,
        ),
        SamplingParams(  # bans until min_tokens; stops by string or id afterwards
            temperature=1.0,
            seed=4,
            max_tokens=6,
            min_tokens=3,
            stop_token_ids=stop_ids,
            stop=["\n", "the"],
            include_stop_str_in_output=True,
        ),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),  # n > 1
    ]
    if structured_output:  # a token mask applied
        variants.append(
            SamplingParams(temperature=0.0, max_tokens=6, constraint=Constraint("json_object"))
        )
    return variants


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run every kernel path once, then reset the engine to fresh. The engine must be
    idle; call it on the thread (or in the process) that steps the engine."""
    if engine.has_unfinished_requests:
        raise WarmupError("warm-up needs an idle engine")
    start = time.monotonic()
    plan = _Plan(engine)
    report = WarmupReport()
    runner = _Runner(engine, report)

    # Prefill shapes, each alone in its steps: 1 and 2 tokens (the skinny rows), a whole
    # budget, and longer than the budget (chunks) when chunking is on.
    for n in (1, 2):
        if plan.fits(n, 2):
            runner.run([_Prompt(plan.tokens(n), greedy())])
    if plan.fits(1, 2):  # the plain seeded race, alone in its step
        runner.run([_Prompt(plan.tokens(1), SamplingParams(seed=7, max_tokens=2))])
    long_len = min(
        plan.max_len - 2, plan.budget + plan.block_size + 1 if plan.chunked else plan.budget
    )
    long_prompt = plan.tokens(long_len) if long_len >= 1 else []
    if long_prompt:
        runner.run([_Prompt(long_prompt, greedy())])
    # Behind a prefix-cache hit: new tokens after cached blocks, and a prompt whose only
    # uncomputed token is its last (it runs as a one-row query among the prefills).
    cached = (len(long_prompt) - 1) // plan.block_size * plan.block_size
    if plan.prefix_caching and cached >= plan.block_size:
        for extra in (3, 1):
            prompt = long_prompt[:cached] + plan.tokens(extra)
            if plan.fits(len(prompt), 2):
                runner.run([_Prompt(prompt, greedy())])

    # Mixed steps: decode rows running when a prompt arrives. Few rows, carrying every
    # sampler path (n > 1: the later candidates compute the prompt's partial last block).
    shared_len = plan.block_size + 1 if plan.block_size > 1 else 2
    joiner_len = max(2, min(2 * plan.block_size + 3, plan.max_len - 8))
    groups: list[list[_Prompt]] = [[]]
    # Building the grammar compiler reads the vocabulary (or finds the model has no
    # structured output, and says so).
    structured_output = engine.grammars.unavailable is None
    for params in sampler_variants(plan.vocab, structured_output):
        length = shared_len if params.n > 1 else 3
        if not plan.fits(length, params.max_tokens):
            continue
        if sum(p.params.n for p in groups[-1]) + params.n > max(1, plan.max_seqs - 1):
            groups.append([])
        groups[-1].append(_Prompt(plan.tokens(length), params))
    for i, group in enumerate(g for g in groups if g):
        # The joiner asks for prompt logprobs, with and without alternatives.
        joiner_params = greedy(2, prompt_logprobs=MAX_LOGPROBS if i == 0 else 0)
        joiner = _Prompt(plan.tokens(joiner_len), joiner_params)
        runner.mixed(group, joiner if plan.fits(joiner_len, 2) else None)

    # Many decode rows: flashinfer's tensor-core decode; as many as a step can take.
    if engine.runner.device.type == "cuda":
        big_joiner = min(plan.block_size + 5, joiner_len)
        # Unchunked, the joiner must fit whole beside the decode rows in one step's budget.
        rows = min(plan.max_seqs - 1, plan.budget - (1 if plan.chunked else big_joiner))
        if rows >= TENSOR_CORE_MIN_BATCH:
            decodes = [_Prompt(plan.tokens(1), greedy(6)) for _ in range(rows)]
            runner.mixed(decodes, _Prompt(plan.tokens(big_joiner), greedy()))

    # Every CUDA-graph batch size a pure-decode step can reach (decode rows never exceed
    # the token budget): b one-token prompts, then one decode step of b rows. Half the
    # rows greedy, half the seeded race; once as they are (the one-pass sampler on the
    # model's logits), once with a penalised row and once with a filtered one (the race on
    # float32 logits, tempered in it or before it). The race kernel specializes on its
    # split, which follows the row count, so each form is built at every count.
    graphs = engine.runner.graphs
    if graphs is not None:
        forms = (None, SamplingParams(seed=1, max_tokens=2, repetition_penalty=1.1))
        forms += (SamplingParams(seed=2, max_tokens=2, top_k=5),)
        for size in graphs.batch_sizes:
            if size > plan.budget:
                break
            for first in forms:
                prompts = [
                    _Prompt(
                        plan.tokens(1), greedy() if i % 2 else SamplingParams(seed=i, max_tokens=2)
                    )
                    for i in range(size)
                ]
                if first is not None:
                    prompts[0] = _Prompt(plan.tokens(1), first)
                runner.run(prompts)
            report.graph_batch_sizes.append(size)

    engine.reset_state()
    # What the warm-up built and the engine keeps (the grammar compiler, the kernels'
    # Python state) leaves the collector's passes, as start-up's did (LLMEngine.__init__):
    # else the first callers' steps pay for walking it.
    gc.collect()
    gc.freeze()
    report.seconds = time.monotonic() - start
    startup = dataclasses.replace(engine.info.startup, warmup=report.seconds)
    engine.info = dataclasses.replace(engine.info, startup=startup)
    log.info(
        "warm-up: %d requests in %d steps, %.2f s (mixed steps with %s decode rows; "
        "CUDA-graph batch sizes %s)",
        report.num_requests,
        report.num_steps,
        report.seconds,
        report.decode_rows_mixed or "no",
        report.graph_batch_sizes or "none",
    )
    return report


class _Runner:
    def __init__(self, engine: LLMEngine, report: WarmupReport):
        self.engine = engine
        self.max_seqs = engine.config.scheduler.max_num_seqs
        self.report = report
        self._ids = 0

    def add(self, prompts: list[_Prompt]) -> list[str]:
        ids = []
        for prompt in prompts:
            request_id = f"{_ID_PREFIX}{self._ids}"
            self._ids += 1
            self.engine.add_request(request_id, prompt.token_ids, prompt.params)
            ids.append(request_id)
        self.report.num_requests += len(prompts)
        return ids

    def step(self) -> None:
        for event in self.engine.step():
            if event.finish_reason is FinishReason.ERROR:
                raise WarmupError(f"warm-up request {event.request_id} failed: {event.error}")
        self.report.num_steps += 1

    def finish(self) -> None:
        while self.engine.has_unfinished_requests:
            self.step()

    def run(self, prompts: list[_Prompt]) -> None:
        self.add(prompts)
        self.finish()

    def mixed(self, decodes: list[_Prompt], joiner: _Prompt | None) -> None:
        """Prefill `decodes`, then add `joiner` while they decode: a mixed step."""
        ids = self.add(decodes)
        requests = [self.engine.requests[i] for i in ids]
        # Until every candidate has its prompt computed and decodes.
        while any(
            any(s.num_computed_tokens < s.num_prompt_tokens for s in r.sequences) for r in requests
        ):
            if not self.engine.has_unfinished_requests:
                break
            self.step()
        if joiner is None:
            self.finish()
        elif self.max_seqs > 1 and self.engine.has_unfinished_requests:
            decoding = sum(1 for r in requests for s in r.sequences if not s.is_finished)
            self.report.decode_rows_mixed.append(decoding)
            self.run([joiner])
        else:  # one sequence at a time: no step mixes, the joiner's paths run alone
            self.finish()
            self.run([joiner])
