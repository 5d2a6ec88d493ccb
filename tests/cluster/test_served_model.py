"""cluster.http.served_model.ServedModel: a route's prompt becomes the EngineRequest every engine
runs, built by the engine's own input processor, so the ingress and the engines cannot disagree
on a prompt or on max_tokens, and no engine tokenizes it again."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError
from cluster.http.served_model import ServedModel
from engine import EngineArgs
from engine.errors import ParameterError
from engine.llm_engine import load_processor
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    tokenizer, processor = load_processor(EngineArgs(tiny_model, max_model_len=64).create_engine_config())
    return ServedModel("tiny", tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))


def test_an_unset_max_tokens_becomes_the_room_left_in_the_context(served):
    unset = SamplingParams(max_tokens=None)  # an OpenAI body without max_tokens
    request = served.request([5, 6, 7], unset)
    assert request.sampling_params.max_tokens == request.max_tokens == 64 - 3
    assert served.request([5, 6, 7], SamplingParams(max_tokens=9)).max_tokens == 9  # a given one is kept


def test_the_request_is_what_every_engine_takes_and_checks_without_tokenizing(served, monkeypatch):
    request = served.request([5, 6, 7], SamplingParams(max_tokens=None, stop=["x"], bad_words=["hello"]), "text")
    assert request.prompt == "text" and request.prompt_token_ids == [5, 6, 7]
    assert request.sampling_params._eos_token_ids and request.sampling_params._bad_words_token_ids
    encodes = []
    monkeypatch.setattr(served.tokenizer, "encode", lambda *a, **k: encodes.append(a))
    served.processor.check(request)  # an engine's check of the built request
    assert encodes == []


def test_a_built_request_over_the_engines_limits_is_refused_by_its_check(served):
    request = served.request([5, 6, 7], SamplingParams(max_tokens=None))
    longer = dataclasses.replace(request, prompt_token_ids=[5] * 10)  # its max_tokens no longer fits
    with pytest.raises(ParameterError) as e:
        served.processor.check(longer)
    assert e.value.field == "max_tokens"


def test_a_prompt_the_engine_would_refuse_is_refused_here_naming_its_field(served):
    with pytest.raises(ParameterError) as e:
        served.request([5] * 64, SamplingParams(max_tokens=None))
    assert e.value.field == "prompt"
    with pytest.raises(ParameterError) as e:
        served.request([5, 6], SamplingParams(max_tokens=63))
    assert e.value.field == "max_tokens" and "<= 62" in str(e.value)


def test_another_models_name_is_a_404(served):
    served.check_model("tiny")
    with pytest.raises(OpenAIError) as e:
        served.check_model("gpt-4")
    assert e.value.status == 404 and e.value.param == "model"


def test_priority_and_cache_salt_reach_the_engine_request(served):
    params = SamplingParams(max_tokens=2)
    prioritized = dataclasses.replace(served, priority_scheduling=True)
    request = prioritized.request([5, 6, 7], params, priority=-3, cache_salt="tenant")
    assert (request.priority, request.cache_salt) == (-3, "tenant")
    with pytest.raises(ParameterError) as e:
        served.request([5, 6, 7], params, priority=1)  # fcfs engines would ignore it
    assert e.value.field == "priority"
