"""Classify models (convert="classify"): a cross-encoder's score head and an LLM's yes/no
token logits as a reranker (Qwen3-Reranker's use), against transformers within 1e-4."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.engine.hf_reference import random_prompts
from tests.engine.pooling_factory import hf_classifier_scores, hf_token_scores, make_classifier

# Qwen3-Reranker's prompt: the instruction and query, then each document, then the assistant's turn.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Find the passage about rivers\n<Query>: where does the river run\n"
DOCS = ["<Document>: The river ran quietly past the mill." + SUFFIX,
        "<Document>: A cat slept." + SUFFIX,
        "<Document>: Mountains rise over the plain, and the water runs down to the sea." + SUFFIX]
# The tiny tokenizer has no one-token "no" and "yes": two one-token words stand in for them.
NO_YES = [" not", " and"]


@pytest.fixture(scope="module")
def cross_encoder(model_factory, tmp_path_factory) -> str:
    return make_classifier(model_factory("llama"), str(tmp_path_factory.mktemp("cross-encoder")))


def test_cross_encoder_scores_match_transformers(cross_encoder):
    llm = LLM(cross_encoder, max_num_batched_tokens=64)  # runner auto: a classifier checkpoint pools
    pooling = llm.engine.processor.pooling
    assert (pooling.task, pooling.classifier, pooling.num_labels) == ("classify", "score", 1)
    tok = llm.get_tokenizer()
    outs = llm.score("where does the river run", [d.removesuffix(SUFFIX) for d in DOCS], use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        ids = tok("where does the river run", doc.removesuffix(SUFFIX))["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(hf_classifier_scores(cross_encoder, ids).item(), abs=1e-4)
    core = llm.engine.core
    assert core.num_free_blocks() == core.num_kv_blocks


def test_multi_label_classifier_probs_match_transformers(model_factory, tmp_path):
    model = make_classifier(model_factory("qwen3"), str(tmp_path), num_labels=3, seed=1)
    prompts = random_prompts([1, 40, 150], 1000, seed=51)
    outs = LLM(model, convert="classify", max_num_batched_tokens=64).classify(
        [{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf_classifier_scores(model, p)
        assert out.outputs.probs == pytest.approx(ref.tolist(), abs=1e-4)


def test_llm_as_reranker_scores_are_the_yes_probability_of_transformers(model_factory):
    model = model_factory("qwen3")
    llm = LLM(model, runner="pooling", convert="classify", hf_overrides={"classifier_from_token": NO_YES})
    token_ids = [llm.get_tokenizer().encode(t, add_special_tokens=False)[0] for t in NO_YES]
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    scores = [o.outputs.score for o in outs]
    for doc, out in zip(DOCS, outs):
        ids = llm.get_tokenizer()(QUERY, doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(hf_token_scores(model, ids, token_ids), abs=1e-4)
    assert len(set(scores)) == 3  # the documents are told apart
