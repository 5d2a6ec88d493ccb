"""Pooling models (runner="pooling"): embeddings against transformers' hidden states pooled
the same way, and sentence-transformers' own encode; the rules read from the model's files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.pooling import PoolingParams
from engine.pooling.config import PoolingModel
from engine.pooling.pooler import Pooler
from tests.engine.hf_reference import random_prompts
from tests.engine.pooling_factory import cosine, hf_pooled, sentence_transformers_dir

LENGTHS = [1, 7, 64, 200, 512]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def qwen3(model_factory) -> str:
    return model_factory("qwen3")


@pytest.fixture(scope="module")
def mean_model(model_factory, tmp_path_factory) -> str:
    """The bench Llama as a sentence-transformers model with mean pooling and Normalize."""
    return sentence_transformers_dir(model_factory("llama", "bench"), str(tmp_path_factory.mktemp("st-mean")),
                                     "MEAN", normalize=True)


def test_qwen3_last_token_embeddings_match_transformers(qwen3):
    # 128-token steps: the long prompts are pooled over several chunks, batched with others.
    llm = LLM(qwen3, runner="pooling", max_num_batched_tokens=128, num_kv_blocks=200)
    prompts = random_prompts(LENGTHS, 1000, seed=31)
    many = llm.embed(_ids(prompts), use_tqdm=False)
    one = llm.embed(_ids(prompts[3:4]), use_tqdm=False)
    for p, out in zip(prompts, many):
        assert len(out.outputs.embedding) == 64 and out.prompt_token_ids == p
        assert cosine(out.outputs.embedding, hf_pooled(qwen3, p, "LAST")) >= 0.9999
        assert torch.tensor(out.outputs.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)
    assert cosine(one[0].outputs.embedding, many[3].outputs.embedding) >= 0.9999
    # Prefill only: every block is free again, no request is left.
    core = llm.engine.core
    assert core.num_free_blocks() == core.num_kv_blocks and not core.has_unfinished_requests()


def test_mean_pooling_from_sentence_transformers_config_matches_transformers(mean_model):
    from sentence_transformers import SentenceTransformer

    from engine.models.make_model import corpus_lines

    llm = LLM(mean_model, convert="embed", max_num_batched_tokens=256, num_kv_blocks=160)
    assert llm.engine.processor.pooling.pooling_type == "MEAN"
    prompts = random_prompts(LENGTHS, 1000, seed=32)
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False)):
        assert cosine(out.outputs.embedding, hf_pooled(mean_model, p, "MEAN")) >= 0.9999
    one = llm.embed(_ids(prompts[-1:]), use_tqdm=False)[0]  # alone: two 256-token chunks, nothing beside
    assert cosine(one.outputs.embedding, hf_pooled(mean_model, prompts[-1], "MEAN")) >= 0.9999
    # sentence-transformers' own encode of texts (its tokenization, pooling and Normalize).
    texts = [" ".join(corpus_lines()[i:i + n]) for i, n in ((0, 1), (5, 3), (20, 12))]
    ref = SentenceTransformer(mean_model, device="cpu").encode(texts, convert_to_tensor=True)
    for r, out in zip(ref, llm.embed(texts, use_tqdm=False)):
        assert cosine(out.outputs.embedding, r) >= 0.9999


def test_cls_pooling_override_and_matryoshka_dimensions(qwen3):
    llm = LLM(qwen3, runner="pooling", pooler_config={"pooling_type": "cls", "dimensions": 48},
              hf_overrides={"is_matryoshka": True})
    prompt = random_prompts([30], 1000, seed=33)[0]
    out = llm.embed(_ids([prompt]), use_tqdm=False)[0]
    assert cosine(out.outputs.embedding, hf_pooled(qwen3, prompt, "CLS", dimensions=48)) >= 0.9999
    short = llm.embed(_ids([prompt]), PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert len(short) == 16 and torch.tensor(short).norm().item() == pytest.approx(1.0, abs=1e-5)
    assert cosine(short, hf_pooled(qwen3, prompt, "CLS", dimensions=16)) >= 0.9999
    raw = llm.embed(_ids([prompt]), PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(raw), hf_pooled(qwen3, prompt, "CLS", False, 48), atol=1e-4)
    with pytest.raises(ParameterError, match="dimensions") as e:
        llm.embed(_ids([prompt]), PoolingParams(dimensions=65), use_tqdm=False)
    assert e.value.field == "dimensions"


@pytest.mark.parametrize("pooling_type", ["LAST", "CLS"])
def test_pooled_tokens_over_chunks_through_a_sliding_window_last_layer_match_transformers(
        model_factory, pooling_type):
    # The last layer runs its attention and MLP for the pooled tokens only (output_rows); here
    # it is a window layer (its KV in the hybrid cache's own group), the prompts run past the
    # window in 32-token chunks, batched with each other.
    model = model_factory("gemma3", layer_types=["full_attention", "sliding_attention"])
    llm = LLM(model, runner="pooling", pooler_config={"pooling_type": pooling_type},
              max_num_batched_tokens=32, max_model_len=128)
    prompts = random_prompts([5, 40, 90, 1], 1000, seed=36)
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False)):
        assert cosine(out.outputs.embedding, hf_pooled(model, p, pooling_type)) >= 0.9999


def test_a_step_computes_the_tokens_it_pools_only_when_it_pools_one_per_prompt():
    def rows(kind, req_ids=("a", "b", "c")):
        pooler = Pooler(PoolingModel("embed", kind, True, 64), torch.float32)
        for r in ("a", "b", "c"):
            pooler.add(r, PoolingParams())
        # a: tokens 0-3 end its prompt; b: tokens 4-9, a chunk from position 6 of 20;
        # c: tokens 10-11, its whole prompt.
        n = len(req_ids)
        return pooler.output_rows(list(req_ids), np.array([5, 6, 0])[:n], np.array([4, 6, 2])[:n],
                                  np.array([9, 20, 2])[:n], np.array([0, 4, 10, 12])[:n + 1])

    assert rows("LAST").tolist() == [3, 11]
    assert rows("CLS").tolist() == [10]
    assert rows("MEAN") is None  # every token is summed
    assert rows("LAST", ("a", "b", "x")) is None  # a request that does not pool needs them all
    assert rows("CLS", ("a", "b")) is None  # nothing pooled: the step computes every token


def test_score_with_an_embedding_model_is_the_cosine_of_the_embeddings(qwen3):
    llm = LLM(qwen3, runner="pooling")
    a, b = random_prompts([12, 30], 1000, seed=35)
    docs = [{"prompt_token_ids": b}, {"prompt_token_ids": a}]
    outs = llm.score({"prompt_token_ids": a}, docs, use_tqdm=False)
    ref = hf_pooled(qwen3, a, "LAST")
    assert outs[0].outputs.score == pytest.approx(cosine(ref, hf_pooled(qwen3, b, "LAST")), abs=1e-4)
    assert outs[1].outputs.score == pytest.approx(1.0, abs=1e-5) and outs[1].prompt_token_ids == a


def test_bad_pooling_requests_name_the_field(qwen3):
    with pytest.raises(ParameterError, match="Matryoshka") as e:
        LLM(qwen3, runner="pooling").embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    assert e.value.field == "dimensions"
    with pytest.raises(ParameterError) as e:
        LLM(qwen3, runner="pooling", pooler_config={"pooling_type": "max"})
    assert e.value.field == "pooler_config.pooling_type"
    with pytest.raises(ParameterError) as e:
        LLM(qwen3, convert="embed", runner="generate")
    assert e.value.field == "convert"


def test_a_pooling_model_does_not_generate_and_a_generating_one_does_not_pool(qwen3):
    pooling = LLM(qwen3, runner="pooling", max_model_len=64)
    with pytest.raises(ParameterError, match="pooling model"):
        pooling.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    # A pooling prompt may fill the context (it generates nothing); one token more may not.
    full = random_prompts([64, 65], 1000, seed=34)
    assert len(pooling.embed(_ids(full[:1]), use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ParameterError, match="at most 64 tokens"):
        pooling.embed(_ids(full[1:]), use_tqdm=False)
    with pytest.raises(ParameterError, match="generates text"):
        LLM(qwen3, max_model_len=64).embed("hello", use_tqdm=False)


def test_sentence_transformers_pooling_modes_and_modules_are_read_or_refused(tmp_path):
    import json

    from engine.pooling.config import sentence_transformers_pooling

    (tmp_path / "1_Pooling").mkdir()
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    for mode, expected in (("pooling_mode_cls_token", "CLS"), ("pooling_mode_lasttoken", "LAST")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True, "pooling_mode_max_tokens": False}))
        assert sentence_transformers_pooling(str(tmp_path)) == (expected, False)  # no Normalize module
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ParameterError, match="pooling_mode_max_tokens") as e:
        sentence_transformers_pooling(str(tmp_path))
    assert e.value.field == "model"
    modules.append({"path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ParameterError, match="Dense"):
        sentence_transformers_pooling(str(tmp_path))
    assert sentence_transformers_pooling(str(tmp_path / "1_Pooling")) is None  # no modules.json
