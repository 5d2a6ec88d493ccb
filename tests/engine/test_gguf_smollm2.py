"""The default model, a real GGUF checkpoint (SmolLM2-135M-Instruct, Q4_1 with a Q8_0
embedding): greedy chat answers equal transformers reading the same file, and a JSON-schema
chat request yields JSON that validates."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.so_oracles import COUNTRY_SCHEMA, FRANCE_QUESTION, assert_valid_json

CHATS = ["What is the capital of France?", "Name a primary color."]


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, max_model_len=512, num_kv_blocks=32)


def _chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_greedy_equals_transformers_on_the_same_file(llm, smollm2):
    prompts = [_chat_ids(llm.get_tokenizer(), q) for q in CHATS]
    # 12 tokens: the first answer ends (EOS) before that, the second does not.
    expected = hf_greedy(smollm2, prompts, 12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text and outs[0].outputs[0].finish_reason == "stop"


def test_the_files_chat_template_and_special_tokens(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    # SmolLM2's template adds its own system prompt when the chat has none.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert llm.engine.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_json_schema_chat_request_yields_json_that_validates(llm):
    prompt = {"prompt_token_ids": _chat_ids(llm.get_tokenizer(), FRANCE_QUESTION)}
    so = StructuredOutputsParams(json=COUNTRY_SCHEMA)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    # The grammar, finished, allowed only EOS: the model stopped, it was not cut off.
    assert out.finish_reason == "stop", out.text
    assert_valid_json(out.text, COUNTRY_SCHEMA)
    assert json.loads(out.text)["capital"] == "Paris"  # the constraint left the model its answer
