"""Both doors reach every field of the engine's inputs: each SamplingParams field a caller
may set, sent by gRPC and by REST as that door spells it, arrives in the SamplingParams the
converter makes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.sampling_params import SamplingParams
from pagedserve.v1 import inference_pb2 as pb
from service.convert import SAMPLING_FIELDS, sampling_params
from service.grpc.messages import generation_request
from service.rest.bodies import ChatCompletionRequest, CompletionRequest, decode

# A value for each field, unlike its default (and exact in float32, gRPC's float).
SENT = {
    "n": 3,
    "temperature": 0.5,
    "top_k": 5,
    "top_p": 0.5,
    "min_p": 0.25,
    "repetition_penalty": 1.5,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 7,
    "max_tokens": 9,
    "min_tokens": 2,
    "stop": ["a"],
    "stop_token_ids": [3],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "logprobs": 2,
    "prompt_logprobs": 1,
    "skip_special_tokens": False,
}
# Not a caller's value: the constraint comes from the request's constraint or a forced call.
NOT_SAMPLING = {"constraint"}


def test_the_field_table_names_every_sampling_field_once():
    settable = {f.name for f in dataclasses.fields(SamplingParams)} - NOT_SAMPLING
    assert set(SAMPLING_FIELDS) == settable
    assert set(SENT) == settable
    defaults = SamplingParams()
    assert all(getattr(defaults, name) != value for name, value in SENT.items())


@pytest.mark.parametrize("name", sorted(SENT))
def test_grpc_reaches_each_field(name):
    request = pb.GenerateRequest(text="hi")
    group, field = SAMPLING_FIELDS[name].grpc.split(".")
    value = SENT[name]
    if isinstance(value, list):
        getattr(getattr(request, group), field).extend(value)
    else:
        setattr(getattr(request, group), field, value)
    params = sampling_params(generation_request(request))
    assert getattr(params, name) == value
    others = {n: getattr(params, n) for n in SENT if n != name}
    assert others == {n: getattr(SamplingParams(), n) for n in others}  # nothing else moved


@pytest.mark.parametrize("name", sorted(SENT))
def test_rest_completions_reach_each_field(name):
    body = {"prompt": "hi", SAMPLING_FIELDS[name].rest: SENT[name]}
    request = decode(json.dumps(body).encode(), CompletionRequest).generation_request()
    assert getattr(sampling_params(request), name) == SENT[name]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"logprobs": True, "top_logprobs": 2}, {"logprobs": 2}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": False}, {"logprobs": None}),
        ({"max_completion_tokens": 9}, {"max_tokens": 9}),
        ({}, {"max_tokens": None}),  # up to the context limit
        ({"temperature": 0.5, "stop": "a"}, {"temperature": 0.5, "stop": ["a"]}),
    ],
)
def test_rest_chat_says_some_fields_its_own_way(body, expected):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    request = decode(json.dumps(body).encode(), ChatCompletionRequest).generation_request()
    params = sampling_params(request)
    assert {name: getattr(params, name) for name in expected} == expected
