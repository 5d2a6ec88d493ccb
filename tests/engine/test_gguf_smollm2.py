"""The default model, a real GGUF checkpoint (SmolLM2-135M-Instruct, Q4_1 with a Q8_0
embedding): greedy chat answers equal transformers reading the same file, and a JSON-schema
chat request yields JSON that validates."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.hf_reference import hf_greedy, hf_mismatches
from tests.engine.so_oracles import COUNTRY_SCHEMA, FRANCE_QUESTION, assert_valid_json

CHATS = ["What is the capital of France?", "Name a primary color."]
# In logits. With int8 activations (llama.cpp's scheme) a top-2 pair closer than this may
# swap against transformers' fp32 (measured: 0.08 and 0.12 on
# two of four 48-token chats; this model's logits spread ~5-8 per position).
REAL_MARGIN = 0.25


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, max_model_len=512, num_kv_blocks=32)


def _chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _llama_cpp_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama.cpp (llama-cpp-python) on the same file: greedy, token by token."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=2, n_ctx=512, verbose=False)
    outs = []
    for p in prompts:
        llm.reset()
        llm.eval(p)
        out = []
        for _ in range(n):
            out.append(llm.sample(top_k=1, temp=0.0))
            if out[-1] == llm.token_eos():
                break
            llm.eval([out[-1]])
        outs.append(out)
    return outs


def test_chat_greedy_equals_transformers_and_with_int8_activations_llama_cpp(llm, smollm2, monkeypatch):
    """Kept in its blocks (the default) and dequantized: transformers' tokens exactly. With
    int8 activations (PDSERVE_QUANT_ACTIVATIONS=int8): llama.cpp's tokens on the same file,
    which quantizes activations the same way (on the first chat both answer "L'Étoile, ..."
    where fp32 answers "The capital of France is Paris."), transformers' within near-ties."""
    from kernels.cpu import quant

    prompts = [_chat_ids(llm.get_tokenizer(), q) for q in CHATS]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    # 12 tokens: the first fp32 answer ends (EOS) before that, the second does not.
    expected = hf_greedy(smollm2, prompts, 12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text and outs[0].outputs[0].finish_reason == "stop"
    dense = LLM(smollm2, max_model_len=512, num_kv_blocks=32, quantization="none")
    outs = dense.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS["int8"])
    int8 = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in int8]
    assert tokens == _llama_cpp_greedy(smollm2, prompts, 12)
    assert hf_mismatches(smollm2, prompts, tokens, REAL_MARGIN) == 0


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
