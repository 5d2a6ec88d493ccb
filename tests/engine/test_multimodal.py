"""LLaVA end to end through LLM.generate: greedy parity with transformers under chunked
prefill and prefix caching, the encoder cache, and input validation."""

from __future__ import annotations

import dataclasses

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.mm_reference import hf_llava, hf_llava_greedy, image

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ONE = "Describe <image> in words"
TWO = "First <image> then <image> compare"


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model_dir, num_kv_blocks=64, block_size=8, max_num_batched_tokens=64, max_model_len=256,
               **kwargs)


@pytest.fixture(scope="module")
def llm(llava_model):
    # Chunks of 5 tokens cut through the 16-token image placeholder ranges.
    return _llm(llava_model, long_prefill_token_threshold=5)


def _run(llm, text, images, params=GREEDY):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params, use_tqdm=False)[0]


def _metric(llm, name):
    return next(m.value for m in llm.get_metrics() if m.name == name)


def test_tiny_llava_has_one_image_token_and_hf_loads_it(llava_model):
    processor, model = hf_llava(llava_model)
    ids = processor.tokenizer.encode("<image>", add_special_tokens=False)
    assert ids == [model.config.image_token_index]
    assert processor(text=ONE, images=[image(0)])["input_ids"][0].count(ids[0]) == 16


@pytest.mark.parametrize("text,seeds", [(ONE, [1]), (TWO, [2, 3])])
def test_greedy_matches_hf_under_chunked_prefill(llm, llava_model, text, seeds):
    images = [image(s) for s in seeds]
    out = _run(llm, text, images)
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_model, text, images, MAX_TOKENS)


def test_the_image_changes_the_output(llm):
    # Guards the parity tests: an engine that ignored the image would not pass them by luck.
    assert _run(llm, ONE, [image(4)]).outputs[0].token_ids != _run(llm, ONE, [image(5)]).outputs[0].token_ids


def test_token_id_prompt_with_lone_placeholder_is_expanded(llm, llava_model):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(ONE)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image(6)}}, GREEDY,
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_model, ONE, [image(6)], MAX_TOKENS)
    assert len(out.prompt_token_ids) == len(ids) + 15


def test_same_text_different_image_shares_no_kv_past_the_image(llava_model):
    llm = _llm(llava_model)
    text = "A longer preamble that fills whole blocks <image> and a tail after the image"
    first = _run(llm, text, [image(7)])
    offset = first.prompt_token_ids.index(hf_llava(llava_model)[1].config.image_token_index)
    again = _run(llm, text, [image(7)])
    other = _run(llm, text, [image(8)])
    assert again.num_cached_tokens > offset + 16  # same image: the KV past it is reused
    assert other.num_cached_tokens <= offset  # different image: nothing from its block on
    assert other.outputs[0].token_ids == hf_llava_greedy(llava_model, text, [image(8)], MAX_TOKENS)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_repeated_image_is_an_encoder_cache_hit(llava_model):
    llm = _llm(llava_model, enable_prefix_caching=False)
    _run(llm, ONE, [image(9)])
    assert _metric(llm, "pdserve:encoder_cache_hits") == 0
    out = _run(llm, "Another question about <image>", [image(9)])
    assert _metric(llm, "pdserve:encoder_cache_queries") == 2
    assert _metric(llm, "pdserve:encoder_cache_hits") == 1
    assert out.outputs[0].token_ids == hf_llava_greedy(
        llava_model, "Another question about <image>", [image(9)], MAX_TOKENS)
    assert _metric(llm, "pdserve:encoder_seconds") > 0


def test_one_image_per_step_budget_never_splits_an_image(llava_model):
    # The encoder budget holds one image: the two images are encoded in different steps and
    # the prompt's chunk stops before the second one.
    llm = _llm(llava_model, max_num_encoder_input_tokens=16, encoder_cache_size=16)
    images = [image(10), image(11)]
    out = _run(llm, TWO, images)
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_model, TWO, images, MAX_TOKENS)


def test_a_batch_shares_the_encoder_cache_and_leaks_nothing(llava_model):
    llm = _llm(llava_model, long_prefill_token_threshold=7)
    prompts = [{"prompt": t, "multi_modal_data": {"image": [image(s) for s in seeds]}}
               for t, seeds in [(ONE, [12]), (TWO, [12, 13]), (ONE, [13]), (TWO, [13, 13])]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_llava_greedy(
            llava_model, p["prompt"], p["multi_modal_data"]["image"], MAX_TOKENS)
    core = llm.engine.core
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks
    assert core.encoder_cache.num_referenced == 0
    # Only images 12 and 13 are encoded; every other lookup hits (an image repeated within a
    # prompt is held by the prompt after its first copy, and not looked up again).
    queries = _metric(llm, "pdserve:encoder_cache_queries")
    assert queries - _metric(llm, "pdserve:encoder_cache_hits") == 2
    assert queries >= 5


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": ONE, "multi_modal_data": {"image": [image(0)] * 5}}, "at most 4 images"),
    ({"prompt": ONE, "multi_modal_data": {"image": [image(0), image(1)]}}, "1 image placeholders"),
    ({"prompt": ONE}, "has no images"),
    ({"prompt": "no placeholder", "multi_modal_data": {"image": image(0)}}, "0 image placeholders"),
    ({"prompt": ONE, "multi_modal_data": {"image": b"not an image"}}, "must be a PIL.Image"),
    ({"prompt": ONE, "multi_modal_data": {"video": []}}, "key 'image'"),
])
def test_bad_multimodal_inputs_name_the_field(llm, prompt, match):
    with pytest.raises(ValueError, match=match) as info:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert info.value.field == "multi_modal_data"
    assert llm.engine.get_num_unfinished_requests() == 0


def test_limit_mm_per_prompt_is_configurable(llava_model):
    llm = _llm(llava_model, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="at most 1 images"):
        _run(llm, TWO, [image(0), image(1)])


def test_an_image_to_a_text_only_model_is_rejected(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="text-only") as info:
        _run(llm, "hello", [image(0)])
    assert info.value.field == "multi_modal_data"


def _request(llm, text, images, params=GREEDY):
    return llm.engine.process({"prompt": text, "multi_modal_data": {"image": images}}, params)


def test_outputs_carry_placeholders_and_hashes_and_decode_gets_no_pixels(llm):
    from cluster.pd.split import decode_request

    out = _run(llm, TWO, [image(14), image(15)])
    features = out.multi_modal_features
    assert [item.offset for item in features.items] == [
        i for i, t in enumerate(out.prompt_token_ids)
        if t == hf_llava(llm.engine_args.model)[1].config.image_token_index
        and (i == 0 or out.prompt_token_ids[i - 1] != t)]
    assert features.items[0].mm_hash != features.items[1].mm_hash
    request = _request(llm, TWO, [image(14), image(15)])
    assert all(item.pixel_values is not None for item in request.mm_features.items)
    decode = decode_request(request, out)
    assert [item.mm_hash for item in decode.mm_features.items] == [item.mm_hash for item in features.items]
    assert all(item.pixel_values is None for item in decode.mm_features.items)


def test_features_without_pixels_are_only_for_a_pd_decode_request(llm):
    request = _request(llm, ONE, [image(16)])
    without = dataclasses.replace(request, mm_features=request.mm_features.without_pixels())
    with pytest.raises(ValueError, match="only for a P/D decode request") as info:
        llm.engine.add(without)
    assert info.value.field == "multi_modal_data"
    assert not llm.engine.has_unfinished_requests()


def test_a_decode_request_that_must_recompute_an_image_fails_and_frees_everything(llava_model):
    # A fresh engine with no connector and no prefix cache: the "decode" request must compute
    # its prompt, image placeholders included, and the image is in no encoder cache, but the
    # request has no pixels. It fails; it must not wait forever.
    from cluster.pd.split import decode_request

    prefill = _llm(llava_model)
    first = _run(prefill, ONE, [image(17)])
    request = _request(prefill, ONE, [image(17)])
    engine = _llm(llava_model, enable_prefix_caching=False).engine
    engine.add(dataclasses.replace(decode_request(request, first), request_id="decode-1"))
    finals = []
    for _ in range(10):  # bounded: a stuck request would leave this loop with no output
        finals += [o for o in engine.step() if o.finished]
        if finals:
            break
    assert [o.outputs[0].finish_reason for o in finals] == ["error"]
    assert "no pixels" in finals[0].outputs[0].stop_reason
    assert engine.get_num_unfinished_requests() == 0
    assert engine.core.kv_cache_manager.get_num_free_blocks() == engine.core.num_kv_blocks


@pytest.mark.parametrize("value,expected", [(None, 4), ({"image": 2}, 2), ('{"image": 0}', 0)])
def test_limit_mm_per_prompt_takes_vllm_forms(value, expected):
    from engine.args import EngineArgs

    config = EngineArgs(model="unused", limit_mm_per_prompt=value).create_engine_config()
    assert config.multimodal.limit_mm_per_prompt == expected


@pytest.mark.parametrize("value", [{"video": 1}, "image=2", {"image": -1}])
def test_bad_limit_mm_per_prompt_names_the_field(value):
    from engine.args import EngineArgs

    with pytest.raises(ValueError) as info:
        EngineArgs(model="unused", limit_mm_per_prompt=value).create_engine_config()
    assert info.value.field == "limit_mm_per_prompt"


def test_preempted_image_requests_resume_with_the_same_tokens(llava_model):
    # 16 blocks of 8 tokens for four ~40-token requests: decode runs out of blocks and
    # preempts; a resumed request re-plans its image (cached, or encoded again).
    llm = LLM(llava_model, num_kv_blocks=16, block_size=8, max_model_len=128, max_num_batched_tokens=64,
              long_prefill_token_threshold=8)
    cases = [(TWO, [image(50), image(51)]), (ONE, [image(52)]), (TWO, [image(51), image(53)]), (ONE, [image(50)])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases], params,
                        use_tqdm=False)
    assert _metric(llm, "vllm:num_preemptions") > 0
    for out, (text, ims) in zip(outs, cases):
        assert out.outputs[0].token_ids == hf_llava_greedy(llava_model, text, ims, 24)
    core = llm.engine.core
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_kv_blocks
    assert core.encoder_cache.num_referenced == 0
