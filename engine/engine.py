"""LLMEngine: the synchronous core. add_request / abort_request / step, nothing else.

One step = schedule -> run the model on the flat batch -> sample -> append tokens,
detokenize, check stops -> events. The offline LLM class and the async engine both
drive this object; neither it nor they know about gRPC or HTTP.
"""

from __future__ import annotations

import atexit
import collections
import gc
import itertools
import logging
import random
import time
from array import array
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from engine.attention.flashinfer_backend import FlashInferAttention
from engine.attention.torch_backend import TorchPagedAttention
from engine.config import EngineConfig
from engine.cuda_graphs import graph_batch_sizes, graph_memory_reserve
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ValidationError
from engine.kernel_cache import apply_kernel_cache_dir
from engine.kv.block_manager import BlockManager, OutOfBlocksError
from engine.model.loader import load_model
from engine.model_store import resolve_model
from engine.outputs import CandidateEvent, FinishReason, TokenLogprob, Usage
from engine.request import Request, Sequence, SequenceStatus
from engine.runner import LaunchedStep, ModelRunner, PendingTokens, SampleRow, kv_bytes_per_block
from engine.sampling_params import SamplingParams, validate_request
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.stats import EngineInfo, EngineStats, StartupTimes
from engine.stop_strings import StopStringMatcher
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# LLMEngine freezes what it builds at start-up out of the garbage collector's passes; the
# interpreter's last collection at exit must see it again (triton's bindings report what
# they find uncollected as leaks).
atexit.register(gc.unfreeze)

_MASK64 = (1 << 64) - 1


@dataclass
class _StepInFlight:
    """A launched step, until its results are collected."""

    chunks: list[ScheduledChunk]
    row_owners: list[tuple[Sequence, int | None]]  # per sample row: (sequence, fork index)
    pending_rows: dict[Sequence, int]  # sequences whose next token it samples -> its row
    launched: LaunchedStep
    collect_before_next: bool  # the next schedule needs this step's tokens on the host


def abort_stage(request: Request) -> str:
    """Where a request is in its life: waiting (never run), prefill, decode, or preempted
    (waiting to be recomputed). With a candidate running, its stage is the request's."""
    live = [s for s in request.sequences if not s.is_finished]
    running = [s for s in live if s.status is SequenceStatus.RUNNING]
    if running:
        prefilling = any(s.num_computed_tokens < s.num_prompt_tokens for s in running)
        return "prefill" if prefilling else "decode"
    return "preempted" if any(s.num_preemptions for s in live) else "waiting"


def candidate_seed(seed: int, index: int) -> int:
    """Candidate 0 keeps the request's seed; the others get well-mixed distinct seeds."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 29
    return x - (1 << 64) if x >= 1 << 63 else x


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # Before anything imports triton or flashinfer: both read their cache paths then.
        apply_kernel_cache_dir(config.kernel_cache_dir)
        started = time.monotonic()
        model_path = resolve_model(config.model)
        self.model_path = model_path
        self.tokenizer = Tokenizer.from_path(model_path)
        device, dtype = config.torch_device, config.torch_dtype
        on_gpu = device.type == "cuda"
        attn = FlashInferAttention(device) if on_gpu else TorchPagedAttention()
        model, self.model_config = load_model(model_path, dtype, device, attn)
        mc = self.model_config
        if isinstance(attn, FlashInferAttention):  # its wrappers need the model's head shape
            attn.configure(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)

        loaded = time.monotonic()
        log.info("model loaded in %.2f s: %s", loaded - started, model_path)

        cache, sched, block_size = config.cache, config.scheduler, config.block_size
        use_graphs = on_gpu and not config.enforce_eager
        self.runner = ModelRunner(model, mc, block_size, device, dtype, attn)
        block_bytes = kv_bytes_per_block(mc, block_size, dtype)
        if cache.num_blocks:
            num_blocks = cache.num_blocks
        elif on_gpu:
            num_blocks = self.runner.fit_kv_blocks(
                cache.gpu_memory_utilization,
                sched.max_num_batched_tokens,
                sched.max_num_seqs,
                graph_memory_reserve(graph_batch_sizes(sched.max_num_seqs), attn)
                if use_graphs
                else 0,
            )
        else:
            num_blocks = max(1, int(cache.kv_cache_memory_gib * 2**30 // block_bytes))
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)

        # A sequence must fit the pool on its own; that is what makes preemption deadlock-free.
        model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.pool_tokens = num_blocks * block_size
        self.max_model_len = min(
            model_len, self.model_config.max_position_embeddings, self.pool_tokens
        )
        sized = time.monotonic()
        log.info("KV pool sized and allocated in %.2f s", sized - loaded)
        if use_graphs:
            self.runner.capture_cuda_graphs(sched.max_num_seqs, self.max_model_len)
            log.info("CUDA graphs captured in %.2f s", time.monotonic() - sized)
        self.startup = StartupTimes(
            model_load=loaded - started,
            kv_profile=sized - loaded,
            cuda_graphs=time.monotonic() - sized if use_graphs else 0.0,
        )
        log.info(
            "engine ready: %s on %s/%s, KV pool %d blocks of %d tokens (%.2f GiB, %d tokens), "
            "max_model_len %d, %s",
            self.model_config.architecture,
            device,
            dtype,
            num_blocks,
            block_size,
            num_blocks * block_bytes / 2**30,
            self.pool_tokens,
            self.max_model_len,
            "CUDA graphs" if use_graphs else "eager",
        )

        self.requests: dict[str, Request] = {}
        self._in_flight: _StepInFlight | None = None  # async scheduling: launched, not collected
        self._start_counting()
        # What start-up built (the model, the tokenizer, the block manager's blocks) lives
        # as long as the engine: keep it out of the collector's full passes, which would
        # otherwise walk it all again and again, a pause of ~0.3 s each on a GPU host.
        gc.freeze()  # (until exit: see the atexit hook at the top)

    # ---- admission -------------------------------------------------------------------

    def tokenize_prompt(
        self,
        prompt: str | None = None,
        prompt_token_ids: SequenceOf[int] | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise ValidationError(
                "prompt", "give exactly one of prompt, prompt_token_ids, messages"
            )
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if prompt is not None:
            return self.tokenizer.encode(prompt)
        return list(prompt_token_ids)  # add_request checks every id against the vocabulary

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        if request_id in self.requests:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        validate_request(params, priority, self.model_config.vocab_size)
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise ValidationError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        # One pass in C over the ids (type(True) is bool, not int); only a prompt that fails
        # it is walked in Python, to name the first bad id.
        if set(map(type, prompt_token_ids)) != {int} or not (
            0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab
        ):
            for i, t in enumerate(prompt_token_ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValidationError(
                        "prompt_token_ids",
                        f"token {i} is {t!r}, expected an integer in [0, {vocab})",
                    )
        limit = self.max_model_len
        if n_prompt >= limit:
            raise ValidationError(
                "prompt",
                f"{n_prompt} tokens leave no room to generate: the context limit is {limit} tokens "
                f"(model {self.model_config.max_position_embeddings}, KV pool {self.pool_tokens})",
            )
        if params.max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + params.max_tokens > limit:
            raise ValidationError(
                "max_tokens",
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"limit of {limit} tokens (model {self.model_config.max_position_embeddings}, "
                f"KV pool {self.pool_tokens})",
            )
        else:
            max_tokens = params.max_tokens

        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            priority=priority,
            arrival_order=next(self._arrivals),
            forked=params.n == 1,
        )
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request.sequences.append(self._new_sequence(request, 0, base_seed))
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])
        return request

    def _new_sequence(self, request: Request, index: int, base_seed: int) -> Sequence:
        params = request.params
        return Sequence(
            request=request,
            index=index,
            seed=candidate_seed(base_seed, index),
            token_ids=array("q", request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )

    def abort_request(self, request_id: str, door: str = "api") -> list[CandidateEvent]:
        """Cancel a request; returns its final CANCELLED events (empty if unknown/finished).
        Counted in stats().aborts under door (who asked) and the stage the request was at."""
        request = self.requests.get(request_id)
        if request is not None:
            self.count_abort(door, abort_stage(request))
        return self._finish_request(request_id, FinishReason.CANCELLED, None)

    def count_abort(self, door: str, stage: str) -> None:
        self.aborts[door, stage] += 1

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests are running, or a step is still in flight (step() collects it)."""
        return bool(self.requests) or self._in_flight is not None

    def reset_state(self) -> None:
        """Forget all that ran, as if just built: after a warm-up, so that metrics and the
        prefix cache see only real traffic, and unseeded requests draw the seeds a fresh
        engine would. The engine must be idle."""
        if self.has_unfinished_requests:
            raise RuntimeError("reset_state needs an idle engine")
        self.block_manager.reset()
        self.scheduler.num_preemptions = 0
        self._start_counting()

    def _start_counting(self) -> None:
        """Arrival order, the seeds of unseeded requests and the cumulative work counters
        (EngineStats) from their beginning. Prompt tokens count what was computed:
        prefix-cache hits are not, a prompt recomputed after preemption is again, and
        recomputed output tokens count in neither."""
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(self.config.seed)
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.aborts: collections.Counter[tuple[str, str]] = collections.Counter()

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_path=str(self.model_path),
            architecture=self.model_config.architecture,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            kv_block_size=self.block_manager.block_size,
            kv_num_blocks=self.block_manager.num_blocks,
            kv_capacity_tokens=self.pool_tokens,
            startup=self.startup,
        )

    def stats(self) -> EngineStats:
        """A snapshot of load and counters; call it on the thread that steps the engine."""
        num_running = len({id(seq.request) for seq in self.scheduler.running})
        bm = self.block_manager
        return EngineStats(
            num_running_requests=num_running,
            num_waiting_requests=len(self.requests) - num_running,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_total=bm.num_blocks,
            prefix_cache_queried_tokens=bm.prefix_cache_stats.queried_tokens,
            prefix_cache_hit_tokens=bm.prefix_cache_stats.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            aborts=tuple((door, stage, n) for (door, stage), n in sorted(self.aborts.items())),
        )

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> list[CandidateEvent]:
        """Schedule and queue a step; return the events of the step that finished.

        With async scheduling the device runs ahead by one step: this call queues step t+1,
        and only then waits for step t and turns its tokens into events, so the host's work
        between two steps overlaps the device's. Without it (the CPU), each call runs its
        own step start to end.
        """
        events: list[CandidateEvent] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and previous.collect_before_next:
            events += self._collect(previous)
            previous = None
        launched = self._launch(self.scheduler.schedule(), previous, events)
        if previous is not None:
            events += self._collect(previous)
        if launched is not None:
            if self.config.overlaps_steps:
                self._in_flight = launched
            else:
                events += self._collect(launched)
        return events

    def _launch(
        self,
        sched: SchedulerOutput,
        previous: _StepInFlight | None,
        events: list[CandidateEvent],
    ) -> _StepInFlight | None:
        """Queue a scheduled step on the device. On a failure its requests end (events)."""
        if sched.is_empty:
            return None
        self.num_steps += 1
        now = time.monotonic()
        for chunk in sched.chunks:
            timing = chunk.seq.request.timing
            timing.first_scheduled = timing.first_scheduled or now

        sample_rows, row_owners = self._sample_rows(sched.chunks)
        prompt_lp_chunks = {
            i: c.seq.request.params.prompt_logprobs
            for i, c in enumerate(sched.chunks)
            if c.start < c.seq.num_prompt_tokens and c.seq.request.prompt_logprobs_pending
        }
        pending = None
        if previous is not None:
            rows = previous.pending_rows
            pending = PendingTokens(
                previous.launched.token_ids,
                {
                    i: rows[c.seq]
                    for i, c in enumerate(sched.chunks)
                    if c.end > len(c.seq.token_ids)
                },
            )
        try:
            launched = self.runner.execute(sched.chunks, sample_rows, prompt_lp_chunks, pending)
        except Exception as exc:  # an engine fault fails this step's requests, not the engine
            events += self._fail_step(sched.chunks, exc)
            return None

        for chunk in sched.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            self.num_prompt_tokens_computed += max(
                0, min(chunk.end, seq.num_prompt_tokens) - chunk.start
            )
            # Blocks are published once the host knows all their tokens; a pending one's
            # block follows with a later step.
            known = min(chunk.end, len(seq.token_ids))
            self.block_manager.register_full_blocks(seq.block_table, seq.token_ids, known)
        pending_rows = {}
        for row, (seq, fork_index) in enumerate(row_owners):
            if fork_index is None:
                seq.num_pending_tokens += 1
                pending_rows[seq] = row
        return _StepInFlight(
            chunks=sched.chunks,
            row_owners=row_owners,
            pending_rows=pending_rows,
            launched=launched,
            # The next step needs this one's tokens on the host when they start new
            # candidates, or feed a penalty's token history.
            collect_before_next=any(
                index is not None or seq.request.params.uses_penalties for seq, index in row_owners
            ),
        )

    def _collect(self, step: _StepInFlight) -> list[CandidateEvent]:
        """Wait for a launched step and turn its results into events."""
        for seq in step.pending_rows:
            seq.num_pending_tokens -= 1
        try:
            result = self.runner.collect(step.launched)
        except Exception as exc:  # e.g. a device error surfacing at the sync
            return self._fail_step(step.chunks, exc)

        for i, lps in result.prompt_logprobs.items():
            chunk = step.chunks[i]
            request = chunk.seq.request
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None]  # the first prompt token has no logprob
            # lps[j] is for prompt position chunk.start + 1 + j; a prefill recomputed after
            # preemption covers positions that already have theirs.
            done = len(request.prompt_logprobs)
            request.prompt_logprobs.extend(lps[done - (chunk.start + 1) :])

        # Fork new candidates before any token lands: a parent that finishes on its first
        # token frees its blocks, and the children must have taken their share by then.
        # A sequence that ended while the step ran (a stop, an abort) drops its token.
        targets = [
            (self._fork(seq, fork_index) if fork_index is not None else seq, sampled)
            for (seq, fork_index), sampled in zip(step.row_owners, result.sampled)
            if not seq.is_finished
        ]
        self.num_generated_tokens += len(targets)
        return [self._append_token(seq, s.token_id, s.logprob) for seq, s in targets]

    def _sample_rows(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[SampleRow], list[tuple[Sequence, int | None]]]:
        """Rows to sample, and for each the sequence it extends (and the fork index, if new)."""
        rows: list[SampleRow] = []
        owners: list[tuple[Sequence, int | None]] = []
        for i, chunk in enumerate(chunks):
            if not chunk.samples:
                continue
            seq = chunk.seq
            request = seq.request
            if request.forked:
                rows.append(self._row(i, seq, seq.seed))
                owners.append((seq, None))
                continue
            # First token of an n > 1 request: every candidate draws from these logits.
            for index in range(request.params.n):
                seed = candidate_seed(request.sequences[0].seed, index)
                rows.append(self._row(i, seq, seed))
                owners.append((seq, index if index > 0 else None))
        return rows, owners

    def _row(self, chunk_index: int, seq: Sequence, seed: int) -> SampleRow:
        params = seq.request.params
        num_sampled = seq.num_sampled_tokens
        banned: list[int] = []
        if num_sampled < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(self.eos_token_ids)
        history = params.uses_penalties  # only penalties read it: no copy per row otherwise
        return SampleRow(
            chunk_index=chunk_index,
            params=params,
            seed=seed,
            num_sampled=num_sampled,
            prompt_ids=seq.request.prompt_token_ids if history else (),
            output_ids=seq.output_token_ids if history else [],
            banned_ids=banned,
        )

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """Create candidate `index` from the parent whose prompt just finished prefilling."""
        request = parent.request
        child = self._new_sequence(request, index, request.sequences[0].seed)
        child.num_cached_tokens = parent.num_cached_tokens
        request.sequences.append(child)
        if len(request.sequences) == request.params.n:
            request.forked = True
        try:
            child.block_table, copy = self.block_manager.fork(
                parent.block_table, parent.num_computed_tokens
            )
        except OutOfBlocksError:  # no block for the copy-on-write: recompute the prompt later
            self.scheduler.add(child)
            return child
        if copy is not None:
            self.runner.copy_blocks([copy])
        child.num_computed_tokens = parent.num_computed_tokens
        self.scheduler.add_running(child)
        return child

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> CandidateEvent:
        request = seq.request
        params = request.params
        seq.token_ids.append(token_id)
        if request.timing.first_token is None:
            request.timing.first_token = time.monotonic()

        text, matched = seq.stop_matcher.feed(seq.detokenizer.add(token_id))
        n_out = seq.num_output_tokens
        reason: FinishReason | None = None
        if matched is not None:
            reason, seq.matched_stop = FinishReason.STOP, matched
        elif token_id in params.stop_token_ids and n_out >= params.min_tokens:
            reason, seq.matched_stop = FinishReason.STOP, token_id
        elif (
            token_id in self.eos_token_ids and not params.ignore_eos and n_out >= params.min_tokens
        ):
            reason = FinishReason.EOS
        elif n_out >= request.max_tokens:
            reason = (
                FinishReason.LENGTH if params.max_tokens is not None else FinishReason.CONTEXT_LIMIT
            )
        if reason is not None and matched is None:
            tail, matched = seq.stop_matcher.feed(seq.detokenizer.flush())
            text += tail
            if matched is not None:
                reason, seq.matched_stop = FinishReason.STOP, matched
            else:
                text += seq.stop_matcher.flush()

        event = CandidateEvent(
            request_id=request.request_id,
            index=seq.index,
            text=text,
            token_ids=[token_id],
            logprobs=[logprob] if logprob is not None else None,
        )
        if seq.index == 0 and request.prompt_logprobs is not None and n_out == 1:
            event.prompt_logprobs = request.prompt_logprobs
        if reason is not None:
            self._finish_sequence(seq, reason, None, event)
        return event

    # ---- endings ----------------------------------------------------------------------

    def _finish_sequence(
        self, seq: Sequence, reason: FinishReason, error: str | None, event: CandidateEvent
    ) -> None:
        request = seq.request
        self.scheduler.remove(seq)
        seq.finish_reason, seq.error = reason, error
        event.finish_reason, event.matched_stop, event.error = reason, seq.matched_stop, error
        event.usage = Usage(
            request.num_prompt_tokens, seq.num_output_tokens, request.sequences[0].num_cached_tokens
        )
        if request.finished:
            request.timing.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
        event.timing = request.timing

    def _finish_request(
        self, request_id: str, reason: FinishReason, error: str | None
    ) -> list[CandidateEvent]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        # Candidates that were never forked end too: a caller expects one final event each.
        pending = [s for s in request.sequences if not s.is_finished]
        for index in range(len(request.sequences), request.params.n):
            seq = self._new_sequence(request, index, request.sequences[0].seed)
            seq.status = SequenceStatus.FINISHED  # never scheduled: holds nothing
            request.sequences.append(seq)
            pending.append(seq)
        request.forked = True
        events = []
        for seq in pending:
            event = CandidateEvent(request_id, seq.index, "", [])
            self._finish_sequence(seq, reason, error, event)
            events.append(event)
        return events

    def _fail_step(self, chunks: list[ScheduledChunk], exc: Exception) -> list[CandidateEvent]:
        """End the requests of a step that raised exc (call from its except block)."""
        log.exception("step failed; failing %d requests", len(chunks))
        error = f"engine error: {type(exc).__name__}: {exc}"
        events: list[CandidateEvent] = []
        for rid in dict.fromkeys(c.seq.request.request_id for c in chunks):
            events.extend(self._finish_request(rid, FinishReason.ERROR, error))
        return events
