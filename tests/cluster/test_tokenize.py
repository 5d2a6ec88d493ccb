"""vLLM's tokenizer routes (cluster.http.tokenize): ids as the model's Hugging Face tokenizer
gives them, conversations counted as /v1/chat/completions counts them, out-of-vocabulary ids a
400 naming `tokens`, what lm-eval's remote tokenizer reads, and the API keys of /v1/*. The same
routes through a deployed app are asked in tests/cluster/test_serve_front_door.py (an app
start is 13-17 s of two cores)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from cluster.http import openai_format as fmt
from cluster.http import tokenize as routes
from cluster.http.errors import OpenAIError
from cluster.http.served_model import ServedModel
from cluster.http.tokenize import DetokenizeRequest, TokenizeRequest
from engine import EngineArgs
from engine.llm_engine import load_processor

TEXT = "The river ran past the old mill."
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    tokenizer, processor = load_processor(EngineArgs(tiny_model, max_model_len=64).create_engine_config())
    return ServedModel("tiny", tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))


# Each route's answer as its JSON says.
def tokenize(served: ServedModel, body: TokenizeRequest) -> dict:
    return json.loads(routes.tokenize(served, body).model_dump_json())


def detokenize(served: ServedModel, body: DetokenizeRequest) -> dict:
    return json.loads(routes.detokenize(served, body).model_dump_json())


def tokenizer_info(served: ServedModel) -> dict:
    return json.loads(routes.tokenizer_info(served).model_dump_json())


def _with_tokenizer(served: ServedModel, edit) -> ServedModel:
    tokenizer = copy.deepcopy(served.tokenizer)
    edit(tokenizer)
    return dataclasses.replace(served, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def bos_front(served) -> ServedModel:
    """The tiny tokenizer made to add a BOS (`<|endoftext|>`), as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    def add_bos(tok):
        bos = tok.convert_tokens_to_ids("<|endoftext|>")
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    return _with_tokenizer(served, add_bos)


def _rejected(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    return e.value


def test_a_prompt_gets_the_tokenizers_ids_with_special_tokens_unless_told_not_to(bos_front):
    tok = bos_front.tokenizer
    with_bos = tokenize(bos_front, TokenizeRequest(prompt=TEXT))
    assert with_bos["tokens"] == tok(TEXT)["input_ids"] and with_bos["tokens"][0] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert with_bos["count"] == len(with_bos["tokens"]) and with_bos["max_model_len"] == 64
    assert with_bos["token_strs"] is None
    plain = tokenize(bos_front, TokenizeRequest(prompt=TEXT, add_special_tokens=False, return_token_strs=True))
    assert plain["tokens"] == tok(TEXT, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])


@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False},
                                   {"continue_final_message": True, "add_generation_prompt": False}])
def test_messages_get_the_chat_templates_ids_without_added_special_tokens(bos_front, flags):
    tok = bos_front.tokenizer
    template = {"add_generation_prompt": flags.get("add_generation_prompt", True),
                "continue_final_message": flags.get("continue_final_message", False)}
    expected = tok.apply_chat_template(CONVERSATION, **template)["input_ids"]
    got = tokenize(bos_front, TokenizeRequest(messages=CONVERSATION, **flags))
    assert got["tokens"] == expected and got["count"] == len(expected)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, **template)
    with_bos = tokenize(bos_front, TokenizeRequest(messages=CONVERSATION, add_special_tokens=True, **flags))
    assert with_bos["tokens"] == tok(text)["input_ids"] and len(with_bos["tokens"]) == len(expected) + 1


def test_chat_template_kwargs_reach_the_template_but_not_its_own_parameters(served):
    def thinking_switch(tok):
        tok.chat_template += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    thinking = _with_tokenizer(served, thinking_switch)
    tok = thinking.tokenizer
    got = tokenize(thinking, TokenizeRequest(messages=CONVERSATION, chat_template_kwargs={"enable_thinking": False}))
    assert got["tokens"] == tok.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                    enable_thinking=False)["input_ids"]
    assert got["tokens"] != tokenize(thinking, TokenizeRequest(messages=CONVERSATION))["tokens"]
    for kwargs in ({"tokenize": True}, {"chat_template": "{{ 'x' }}"}):
        e = _rejected(tokenize, thinking, TokenizeRequest(messages=CONVERSATION, chat_template_kwargs=kwargs))
        assert e.status == 400 and e.param == "chat_template_kwargs"


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": TEXT, "messages": CONVERSATION}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "file:///x.png"}}]}]},
     "messages[0].content[1]"),
])
def test_a_body_without_exactly_one_text_input_is_a_400_naming_the_field(served, body, param):
    e = _rejected(tokenize, served, TokenizeRequest(**body))
    assert e.status == 400 and e.param == param


def test_model_is_optional_but_if_given_must_be_the_served_one(served):
    assert tokenize(served, TokenizeRequest(model="tiny", prompt=TEXT))["count"] > 0
    e = _rejected(tokenize, served, TokenizeRequest(model="gpt-4", prompt=TEXT))
    assert e.status == 404 and e.param == "model"
    e = _rejected(detokenize, served, DetokenizeRequest(model="gpt-4", tokens=[1]))
    assert e.status == 404


def test_detokenize_gives_the_tokenizers_text_and_refuses_ids_outside_its_vocabulary(served):
    tok = served.tokenizer
    ids = tok(TEXT)["input_ids"] + [tok.eos_token_id]
    assert detokenize(served, DetokenizeRequest(tokens=ids)) == {"prompt": tok.decode(ids)}
    assert detokenize(served, DetokenizeRequest(tokens=ids))["prompt"] == TEXT + tok.eos_token
    for bad in (len(tok), -1):
        e = _rejected(detokenize, served, DetokenizeRequest(tokens=[5, bad]))
        assert e.status == 400 and e.param == "tokens" and str(bad) in e.message


def test_tokenizer_info_has_what_lm_evals_remote_tokenizer_reads(served):
    tok = served.tokenizer
    info = tokenizer_info(served)
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (tok.eos_token, tok.bos_token, tok.pad_token)
    assert info["chat_template"] == tok.chat_template
    assert info["max_model_len"] == 64 and info["model_max_length"] == tok.model_max_length
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # lm-eval's eos_token_id: the first id of /tokenize of the eos string, without specials.
    eos = tokenize(served, TokenizeRequest(prompt=info["eos_token"], add_special_tokens=False))["tokens"]
    assert eos == [tok.eos_token_id]
