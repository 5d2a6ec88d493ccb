"""cluster.http.protocol: OpenAI request bodies, the fields pdserve refuses, the mapping to
SamplingParams, and which request field (OpenAI's `param`) an engine field error belongs to."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from engine.errors import ParameterError

MSG = [{"role": "user", "content": "hi"}]


def _completion(**kw) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=kw.pop("prompt", "hello"), **kw)


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=kw.pop("messages", MSG), **kw)


# --- prompts() --------------------------------------------------------------------------------


def test_prompts_of_a_string():
    assert _completion(prompt="Once upon").prompts() == ["Once upon"]


def test_prompts_of_a_token_list():
    assert _completion(prompt=[5, 6, 7]).prompts() == [[5, 6, 7]]


def test_prompts_of_a_string_batch():
    assert _completion(prompt=["a", "b c", "d"]).prompts() == ["a", "b c", "d"]


def test_prompts_of_a_token_list_batch():
    assert _completion(prompt=[[1, 2], [3], [4, 5, 6]]).prompts() == [[1, 2], [3], [4, 5, 6]]


def test_an_empty_prompt_list_is_one_empty_prompt():
    """So the engine's own empty-prompt check rejects it (one rule, one message)."""
    assert _completion(prompt=[]).prompts() == [[]]


def test_prompts_returns_a_new_list():
    req = _completion(prompt=[1, 2, 3])
    out = req.prompts()
    out[0].append(99)
    assert req.prompts() == [[1, 2, 3]]


# --- check_supported() -----------------------------------------------------------------------


def _rejected(req) -> ParameterError:
    with pytest.raises(ParameterError) as exc:
        req.sampling_params()
    return exc.value


def test_defaults_are_supported():
    _completion().sampling_params()
    _chat().sampling_params()


@pytest.mark.parametrize("field, value", [
    ("n", 0),  # n > 1 is supported (engine.parallel_sampling); 0 is out of range
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("logit_bias", {"50256": -100.5}),
    ("logit_bias", {"fifty": 1.0}),
    ("logit_bias", {"-3": 1.0}),
    ("allowed_token_ids", []),
    ("bad_words", [" "]),
    ("prompt_logprobs", -1),
])
def test_common_fields_out_of_range(field, value):
    for req in (_completion(**{field: value}), _chat(**{field: value})):
        err = _rejected(req)
        assert err.field == field and req.param(err.field) == field
        assert field in str(err)


@pytest.mark.parametrize("field, value, engine", [
    ("n", 1, 1),
    ("presence_penalty", 0.5, 0.5),
    ("frequency_penalty", -0.3, -0.3),
    ("logit_bias", {"50256": -100.0, "7": 2}, {50256: -100.0, 7: 2}),
    ("logit_bias", {}, None),
    ("repetition_penalty", 1.2, 1.2),
    ("repetition_penalty", None, 1.0),
    ("allowed_token_ids", [3, 4], [3, 4]),
    ("bad_words", ["no"], ["no"]),
    ("prompt_logprobs", 2, 2),
])
def test_common_fields_reach_the_engine(field, value, engine):
    assert getattr(_completion(**{field: value}).sampling_params(), field) == engine
    assert getattr(_chat(**{field: value}).sampling_params(), field) == engine


def test_echo_with_logprobs_scores_the_prompt():
    assert _completion(echo=True, logprobs=2).sampling_params().prompt_logprobs == 2
    assert _completion(echo=True, logprobs=1, prompt_logprobs=4).sampling_params().prompt_logprobs == 4
    assert _completion(logprobs=2).sampling_params().prompt_logprobs is None
    assert _completion(echo=True).sampling_params().prompt_logprobs is None
    # max_tokens=0 scores the prompt only: the engine samples one token the answer leaves out.
    assert _completion(echo=True, logprobs=1, max_tokens=0).sampling_params().max_tokens == 1
    req = _completion(echo=True, logprobs=1)
    assert req.param("prompt_logprobs") == "logprobs"


def test_chat_prompt_logprobs_are_not_streamed():
    err = _rejected(_chat(prompt_logprobs=1, stream=True))
    assert err.field == "prompt_logprobs"


@pytest.mark.parametrize("kw, param", [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_completion_unsupported(kw, param):
    err = _rejected(_completion(**kw))
    assert err.field == param and str(err)


@pytest.mark.parametrize("kw", [
    {"best_of": 1},
    {"best_of": None},
    {"echo": True},
    {"echo": True, "logprobs": 1},
    {"echo": True, "logprobs": 0, "max_tokens": 0},
    {"logprobs": 3},
    {"suffix": ""},
])
def test_completion_supported(kw):
    _completion(**kw).sampling_params()


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
])
def test_chat_unsupported(kw, param):
    err = _rejected(_chat(**kw))
    assert err.field == param and str(err)


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "text"}},
    {"top_logprobs": 2, "logprobs": True},
    {"logprobs": True},
    {"tools": []},
])
def test_chat_supported(kw):
    _chat(**kw).sampling_params()


def test_unknown_fields_are_ignored():
    req = CompletionRequest(model="m", prompt="x", not_a_field=3)
    assert not hasattr(req, "not_a_field")
    req.sampling_params()


# --- param(): engine field -> request field ---------------------------------------------------


@pytest.mark.parametrize("field", ["prompt", "max_tokens", "logprobs", "temperature", "stop_token_ids"])
def test_completion_params_are_the_engine_fields(field):
    assert _completion().param(field) == field


@pytest.mark.parametrize("kw, field, param", [
    ({}, "prompt", "messages"),
    ({}, "logprobs", "top_logprobs"),
    ({}, "max_tokens", "max_tokens"),
    ({"max_tokens": 5}, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": 5}, "max_tokens", "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 7}, "max_tokens", "max_completion_tokens"),
    ({}, "temperature", "temperature"),
])
def test_chat_params_name_the_field_the_client_sent(kw, field, param):
    assert _chat(**kw).param(field) == param


def test_chat_max_completion_tokens_error_names_it():
    req = _chat(max_completion_tokens=0)
    err = _rejected(req)
    assert err.field == "max_tokens" and req.param(err.field) == "max_completion_tokens"


def test_chat_top_logprobs_error_names_it():
    req = _chat(logprobs=True, top_logprobs=30)
    # The engine's max_logprobs bounds it (the front end's processor: a 400 naming this param).
    assert req.sampling_params().logprobs == 30
    assert req.param("logprobs") == "top_logprobs"


# --- chat properties --------------------------------------------------------------------------


def test_max_completion_tokens_takes_precedence():
    assert _chat(max_tokens=10, max_completion_tokens=20).max_new_tokens == 20
    assert _chat(max_tokens=30, max_completion_tokens=5).max_new_tokens == 5
    assert _chat(max_tokens=10).max_new_tokens == 10
    assert _chat(max_completion_tokens=7).max_new_tokens == 7
    assert _chat().max_new_tokens is None


def test_completion_max_tokens_defaults_to_16():
    assert _completion().max_tokens == 16


def test_num_logprobs():
    assert _chat().num_logprobs is None
    assert _chat(logprobs=False).num_logprobs is None
    assert _chat(logprobs=True).num_logprobs == 0
    assert _chat(logprobs=True, top_logprobs=0).num_logprobs == 0
    assert _chat(logprobs=True, top_logprobs=5).num_logprobs == 5


def test_conversation_joins_text_parts():
    req = _chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None},
        {"role": "developer", "content": []},
        {"role": "tool", "content": "42", "name": "calc"},
    ])
    assert req.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": ""},
        {"role": "developer", "content": ""},
        {"role": "tool", "content": "42"},
    ]


def test_stream_options():
    assert not _chat().include_usage
    assert not _chat().continuous_usage
    req = _completion(stream=True, stream_options={"include_usage": True})
    assert req.include_usage and not req.continuous_usage
    req = _chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert req.continuous_usage and not req.include_usage


# --- validation -------------------------------------------------------------------------------


def test_unknown_role_rejected():
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "wizard", "content": "abracadabra"}])


def test_empty_messages_rejected():
    with pytest.raises(ValidationError):
        _chat(messages=[])


def test_messages_required():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m")


def test_model_and_prompt_required():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x")
    with pytest.raises(ValidationError):
        CompletionRequest(model="m")


def test_text_part_type_must_be_text():
    with pytest.raises(ValidationError):
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}])


# --- sampling_params() ------------------------------------------------------------------------


def test_sampling_params_defaults():
    sp = _completion().sampling_params()
    assert sp.temperature == 1.0
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.min_p == 0.0
    assert sp.seed is None
    assert sp.max_tokens == 16
    assert sp.min_tokens == 0
    assert sp.stop == []
    assert sp.stop_token_ids == []
    assert sp.ignore_eos is False
    assert sp.logprobs is None
    assert sp.skip_special_tokens is True
    assert sp.include_stop_str_in_output is False
    assert sp.n == 1


def test_sampling_params_maps_fields():
    req = _chat(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, min_tokens=2,
                stop=["\n\n", "END"], stop_token_ids=[2, 3], ignore_eos=True, skip_special_tokens=False,
                include_stop_str_in_output=True, max_completion_tokens=50, logprobs=True, top_logprobs=3)
    sp = req.sampling_params()
    assert sp.temperature == 0.7
    assert sp.top_p == 0.9
    assert sp.top_k == 40
    assert sp.min_p == 0.05
    assert sp.seed == 1234
    assert sp.max_tokens == 50
    assert sp.min_tokens == 2
    assert sp.stop == ["\n\n", "END"]
    assert sp.stop_token_ids == [2, 3]
    assert sp.ignore_eos is True
    assert sp.logprobs == 3
    assert sp.skip_special_tokens is False
    assert sp.include_stop_str_in_output is True


def test_sampling_params_zero_values_are_kept():
    # 0 is a value, not "unset": temperature 0 is greedy
    sp = _completion(temperature=0.0, top_k=0, min_p=0.0, max_tokens=None, logprobs=0).sampling_params()
    assert sp.temperature == 0.0
    assert sp.greedy
    assert sp.top_k == 0
    assert sp.max_tokens is None
    assert sp.logprobs == 0


def test_sampling_params_single_stop_string_and_top_k_minus_one():
    sp = _completion(stop="###", top_k=-1, max_tokens=4).sampling_params()
    assert sp.stop == ["###"]
    assert sp.top_k == 0


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": 10}, "min_tokens"),  # more than max_tokens=5
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_sampling_params_out_of_range_names_the_field(kw, field):
    err = _rejected(_completion(max_tokens=5, **kw))
    assert err.field == field and field in str(err)


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),  # above max_logprobs: the engine's processor (a 400, test_serve_pd)
])
def test_completion_bad_max_tokens_and_logprobs_name_the_field(kw, field):
    err = _rejected(_completion(**kw))
    assert err.field == field and field in str(err)
