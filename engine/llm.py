"""The offline, synchronous API: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineConfig, engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.core.warmup import warm_up
from engine.outputs import RequestOutput, RequestOutputBuilder
from engine.sampling_params import SamplingParams
from engine.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        warmup: bool = False,
        **settings,
    ):
        """`settings` are flat engine knobs (device, dtype, block_size, num_blocks, ...).

        warmup runs engine/core/warmup.py first. Off by default: offline there is no readiness
        to hold back and no first caller to spare, and a batch pays a kernel's build once
        either way; a benchmark that times steady state turns it on."""
        if config is None:
            config = engine_config_from_flat(model=model, **settings)
        self.engine = LLMEngine(config)
        if warmup:
            warm_up(self.engine)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoder = self.engine.prompts
        token_lists = [
            encoder.prompt(p) if isinstance(p, str) else encoder.prompt(token_ids=p)
            for p in prompts
        ]
        return self._run(token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation, rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        encoder = self.engine.prompts
        token_lists = [encoder.prompt(messages=list(c)) for c in conversations]
        return self._run(token_lists, sampling_params, use_tqdm)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError("sampling_params must be one value or one per prompt")

        builders = {}
        try:
            for tokens, params in zip(token_lists, params_list):
                request = self.engine.add_request(f"offline-{next(self._ids)}", tokens, params)
                builders[request.request_id] = RequestOutputBuilder.start(
                    request.request_id, request.prompt_token_ids, params.n
                )
        except Exception:  # a bad prompt or parameter: the batch runs all or nothing
            for request_id in builders:
                self.engine.abort_request(request_id)
            raise
        token_lists.clear()  # the requests hold them now, as tuples (see engine/core/request.py)
        request_ids = list(builders)
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests:
            for event in self.engine.step():
                builder = builders[event.request_id]
                builder.add(event)
                if event.finished and builder.finished:
                    bar.update()
        bar.close()
        return [builders[rid].build() for rid in request_ids]
