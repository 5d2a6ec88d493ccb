"""Requests whose constraints conflict: a hard constraint (the grammar, allowed_token_ids)
leaving only tokens that a soft one (min_tokens, bad_words) bans. The hard one wins: a row is
never left with nothing to sample (an all -inf row would sample token 0, outside both); a
grammar complete before min_tokens stops the request; and a grammar that shares no token with
allowed_token_ids ends the request with an error the serving layer answers as a 400."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.structured_output.backend import GRAMMAR_FAILURE


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=tiny_model, max_model_len=128)


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _one(llm, **params):
    return llm.generate(["hello there"], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_does_not_empty_a_row_that_allowed_token_ids_restricts(llm, tok, temperature):
    out = _one(llm, max_tokens=5, min_tokens=3, allowed_token_ids=[tok.eos_token_id], temperature=temperature, seed=3)
    assert out.token_ids and set(out.token_ids) == {tok.eos_token_id}, out.token_ids


def test_bad_words_do_not_empty_a_row_that_allowed_token_ids_restricts(llm, tok):
    [word] = tok.encode(" the", add_special_tokens=False)[:1]
    out = _one(llm, max_tokens=4, allowed_token_ids=[word], bad_words=[" the"], temperature=0, ignore_eos=True)
    assert out.token_ids == [word] * 4


def test_a_grammar_complete_before_min_tokens_stops_the_request(llm):
    out = _one(llm, max_tokens=8, min_tokens=5, temperature=0, structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert (out.text, out.finish_reason) == ("a", "stop")
    # Without min_tokens the grammar's EOS ends it, as before.
    free = _one(llm, max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert (free.text, free.finish_reason) == ("a", "stop") and len(free.token_ids) == len(out.token_ids) + 1


def test_a_grammar_sharing_no_token_with_allowed_token_ids_is_an_error_naming_the_grammar(llm, tok):
    out = _one(llm, max_tokens=4, temperature=0, allowed_token_ids=[tok.eos_token_id],
               structured_outputs=StructuredOutputsParams(choice=["hello"]))
    assert out.finish_reason == "error" and out.stop_reason.startswith(GRAMMAR_FAILURE), out


def test_the_serving_layer_answers_a_grammar_failure_as_the_requests_fault():
    from cluster.http.errors import OpenAIError, replica_error
    from cluster.http.runner import _failure
    from cluster.replica.errors import ReplicaError

    answer = replica_error(_failure(f"{GRAMMAR_FAILURE}token 0 not allowed"))
    assert isinstance(answer, OpenAIError) and answer.status == 400 and answer.param == "structured_outputs"
    assert isinstance(_failure("the KV load failed"), ReplicaError)
    assert replica_error(_failure("the KV load failed")).status == 503
