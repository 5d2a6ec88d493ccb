"""Each bound of cluster/http/request_limits.py on a parsed body, and the flags that set them.
Through a real server: tests/cluster/test_serve_limits.py."""

from __future__ import annotations

import pytest

from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.request_limits import RequestLimits
from engine.errors import ParameterError

VOCAB = 100
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LIMITS = RequestLimits(max_tools=2, max_stop_strings=2, max_bad_words=2, max_guided_choices=2, max_guided_bytes=64)


def _tools(n):
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


@pytest.mark.parametrize("field,at_bound,over", [
    ("tools", _tools(2), _tools(3)),
    ("stop", ["a", "b"], ["a", "b", "c"]),
    ("bad_words", ["a", "b"], ["a", "b", "c"]),
    ("guided_choice", ["a", "b"], ["a", "b", "c"]),
    ("allowed_token_ids", list(range(VOCAB)), list(range(VOCAB)) + [0]),
    ("stop_token_ids", list(range(VOCAB)), [1] * (VOCAB + 1)),
    ("logit_bias", {str(i): 1.0 for i in range(VOCAB)}, {str(i): 1.0 for i in range(VOCAB + 1)}),
    ("guided_regex", "a" * 64, "a" * 65),
    ("guided_json", {"type": "object"}, {"type": "object", "description": "x" * 64}),
])
def test_a_list_at_its_bound_is_taken_and_one_more_is_a_400_naming_the_field(field, at_bound, over):
    LIMITS.check(ChatCompletionRequest(**CHAT, **{field: at_bound}), VOCAB, 8)
    with pytest.raises(ParameterError) as e:
        LIMITS.check(ChatCompletionRequest(**CHAT, **{field: over}), VOCAB, 8)
    assert e.value.field == field


def test_structured_outputs_choices_and_size_are_bounded_too():
    with pytest.raises(ParameterError, match="structured_outputs.choice has 3 entries; at most 2"):
        LIMITS.check(ChatCompletionRequest(**CHAT, structured_outputs={"choice": ["a", "b", "c"]}), VOCAB, 8)
    with pytest.raises(ParameterError, match="response_format is .* bytes; at most 64"):
        LIMITS.check(ChatCompletionRequest(**CHAT, response_format={"type": "json_schema", "json_schema": {
            "name": "x" * 80, "schema": {}}}), VOCAB, 8)


def test_a_batch_of_prompts_times_n_is_counted_before_any_is_tokenized():
    LIMITS.check(CompletionRequest(model="m", prompt=["a"] * 4, n=2), VOCAB, 8)
    with pytest.raises(ParameterError, match=r"5 prompts x n=2 = 10 sequences; at most 8") as e:
        LIMITS.check(CompletionRequest(model="m", prompt=["a"] * 5, n=2), VOCAB, 8)
    assert e.value.field == "prompt"
    LIMITS.check(CompletionRequest(model="m", prompt=list(range(50))), VOCAB, 8)  # one prompt of ids


def test_a_batch_over_the_processes_bound_is_refused_while_it_is_parsed(monkeypatch):
    from pydantic import ValidationError

    monkeypatch.setattr(CompletionRequest, "max_prompts", 3)
    assert CompletionRequest(model="m", prompt=[[1]] * 3).prompts() == [[1]] * 3
    with pytest.raises(ValidationError, match="the request holds 4 prompts; at most 3"):
        CompletionRequest(model="m", prompt=[[1]] * 4)


@pytest.mark.parametrize("field", ["max_tools", "max_stop_strings", "max_bad_words", "max_guided_choices",
                                   "max_guided_bytes", "max_image_pixels"])
def test_a_bound_must_be_a_positive_integer(field):
    with pytest.raises(ParameterError) as e:
        RequestLimits(**{field: 0})
    assert e.value.field == field


def test_the_serve_flags_reach_the_ingress_settings(tiny_model):
    from cluster.launch.cli import build_parser
    from cluster.launch.serve_cli import _config

    args = build_parser().parse_args(["serve", "--model", tiny_model, "--max-tools", "7", "--max-stop-strings", "3",
                                      "--max-bad-words", "4", "--max-guided-choices", "5", "--max-guided-bytes", "6",
                                      "--max-image-pixels", "8", "--metrics-without-key"])
    cfg = _config(args)
    assert cfg.request_limits() == RequestLimits(7, 3, 4, 5, 6, 8) and cfg.metrics_without_key
