"""Multi-LoRA offline: greedy output equals PEFT's for adapters of different rank and target
sets mixed in one batch with base-model requests; slots and the host cache under pressure;
prefix caching that never shares KV across adapters; bad adapters refused by field."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from engine.kv_cache.hashing import extend_block_hashes
from engine.lora import LoRAConfig, LoRARequest
from engine.lora.sched import lora_slots_full
from tests.engine.hf_reference import random_prompts
from tests.engine.lora_factory import make_peft_adapter, peft_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N = 16


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    """The tiny model and two adapters: rank 8 on q/v, and rank 16 rsLoRA on every projection."""
    d = tmp_path_factory.mktemp("adapters")
    a1 = make_peft_adapter(tiny_model, str(d / "a1"), 8, ["q_proj", "v_proj"], seed=1)
    a2 = make_peft_adapter(tiny_model, str(d / "a2"), 16, ALL, alpha=32, use_rslora=True, seed=2, scale=0.5)
    vocab = json.load(open(os.path.join(tiny_model, "config.json")))["vocab_size"]
    return tiny_model, a1, a2, vocab


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _expected(base, prompts, loras):
    """PEFT's greedy answer for each prompt under its adapter (None: the base model)."""
    return [peft_greedy(base, None if lr is None else lr.lora_path, [p], N)[0] for p, lr in zip(prompts, loras)]


def test_mixed_batch_of_two_adapters_and_the_base_model_matches_peft(lora_setup):
    base, a1, a2, vocab = lora_setup
    r1, r2 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)
    prompts = random_prompts([5, 9, 17, 33, 12, 7, 21, 3], vocab, seed=3)
    loras = [r1, r2, None, r1, r2, None, r2, r1]
    expected = _expected(base, prompts, loras)
    # The adapters matter: each changes some answer of the base model.
    base_answers = peft_greedy(base, None, prompts, N)
    assert any(e != b for e, b, lr in zip(expected, base_answers, loras) if lr is r1)
    assert any(e != b for e, b, lr in zip(expected, base_answers, loras) if lr is r2)
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        outs = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=N), lora_request=loras,
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert _tokens(outs) == expected


@pytest.mark.gpu
def test_triton_kernels_run_a_mixed_batch_as_peft_does(lora_setup, device):
    """The whole engine path with the Triton LoRA kernels (interpreted on CPU, compiled on CUDA)."""
    base, a1, a2, vocab = lora_setup
    r1, r2 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)
    prompts = random_prompts([5, 11, 8], vocab, seed=6)
    loras = [r1, None, r2]
    llm = LLM(base, max_model_len=64, enable_lora=True, max_loras=2, kernel_backend="triton", device=device,
              dtype="float32")  # exact parity with PEFT (CUDA's `auto` is bf16)
    try:
        outs = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=6), lora_request=loras,
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert _tokens(outs) == [peft_greedy(base, None if lr is None else lr.lora_path, [p], 6)[0]
                             for p, lr in zip(prompts, loras)]


def test_one_slot_and_one_host_copy_still_answer_every_adapter_correctly(lora_setup):
    """max_loras=1: the scheduler keeps each step to one adapter (the runner raises if a step
    holds two), and with max_cpu_loras=1 the adapters are read from disk again as they alternate."""
    base, a1, a2, vocab = lora_setup
    r1, r2 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)
    prompts = random_prompts([6, 11, 8, 14, 9, 5], vocab, seed=4)
    loras = [r1, r2, r1, None, r2, r1]
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    try:
        outs = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=N), lora_request=loras,
                            use_tqdm=False)
        runner = llm.engine.core.executor.worker.runner.lora
        assert runner.loads >= 2  # both adapters went through the single slot
    finally:
        llm.shutdown()
    assert _tokens(outs) == _expected(base, prompts, loras)


def test_prefix_cache_serves_an_adapters_kv_only_to_the_same_adapter(lora_setup):
    base, a1, a2, vocab = lora_setup
    r1, r2 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)
    prompt = random_prompts([70], vocab, seed=5)[0]  # several full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=N)
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        runs = [(lr, llm.generate(_ids([prompt]), params, lora_request=lr, use_tqdm=False)[0])
                for lr in (r1, r2, None, r1)]
    finally:
        llm.shutdown()
    cached = [out.num_cached_tokens for _, out in runs]
    assert cached[:3] == [0, 0, 0]  # a2 and the base model find none of a1's blocks
    assert cached[3] >= 64  # a1 again: its own blocks
    for lr, out in runs:
        assert list(out.outputs[0].token_ids) == _expected(base, [prompt], [lr])[0]


def test_block_hashes_depend_on_the_adapter_name():
    tokens = list(range(40))
    hashes = {}
    for name in (None, "a1", "a2"):
        hashes[name] = []
        extend_block_hashes(hashes[name], tokens, 16, None, None, name)
    assert len({tuple(h) for h in hashes.values()}) == 3
    assert all(len({h[i] for h in hashes.values()}) == 3 for i in range(2))  # every block differs


def test_scheduler_admits_a_new_adapter_only_while_slots_remain():
    class R:
        def __init__(self, lr):
            self.lora_request = lr

    a, b, c = (LoRARequest(n, i, f"/x/{n}") for i, n in enumerate("abc", 1))
    running = [R(a), R(b), R(None)]
    assert lora_slots_full(R(c), running, 2)
    assert not lora_slots_full(R(a), running, 2)  # already running: no new slot
    assert not lora_slots_full(R(None), running, 2)
    assert not lora_slots_full(R(c), running, 3)


def test_an_adapter_above_max_lora_rank_is_refused_naming_the_field(lora_setup):
    base, _, a2, _ = lora_setup
    llm = LLM(base, enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(ParameterError) as e:
            llm.generate("hello", SamplingParams(max_tokens=2), lora_request=LoRARequest("a2", 2, a2), use_tqdm=False)
        assert e.value.field == "max_lora_rank" and "r=16" in str(e.value)
        with pytest.raises(ParameterError) as e:
            llm.generate("hello", lora_request=LoRARequest("gone", 3, "/nonexistent/adapter"), use_tqdm=False)
        assert e.value.field == "lora_path"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_bad_adapters_are_refused_naming_the_field(lora_setup, tmp_path):
    from engine.lora.peft import load_adapter
    from engine.models.arch import load_arch

    base, a1, _, _ = lora_setup
    arch, config = load_arch(base), LoRAConfig(max_lora_rank=16)
    weights = {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, arch.hidden_size)}
    cases = {
        "target_modules": (weights, {}),
        "use_dora": (None, {"use_dora": True}),
        "modules_to_save": (None, {"modules_to_save": ["lm_head"]}),
    }
    for field, (tensors, cfg_changes) in cases.items():
        d = tmp_path / field
        d.mkdir()
        cfg = {**json.load(open(os.path.join(a1, "adapter_config.json"))), **cfg_changes}
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        from safetensors.torch import load_file, save_file

        save_file(tensors or load_file(os.path.join(a1, "adapter_model.safetensors")),
                  str(d / "adapter_model.safetensors"))
        with pytest.raises(ParameterError) as e:
            load_adapter(field, str(d), arch, config)
        assert e.value.field == field, (field, str(e.value))
    # An adapter of a model with another hidden size: its shapes name the path.
    other = load_arch(base)
    import dataclasses

    with pytest.raises(ParameterError) as e:
        load_adapter("a1", a1, dataclasses.replace(other, hidden_size=other.hidden_size * 2), config)
    assert e.value.field == "lora_path" and "another model" in str(e.value)


def test_lora_settings_and_requests_are_checked_by_field(tiny_model):
    for kwargs, field in (({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 1024}, "max_lora_rank"),
                          ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras")):
        with pytest.raises(ParameterError) as e:
            LoRAConfig(**kwargs)
        assert e.value.field == field
    for args, field in ((("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id"), (("a", 1, ""), "lora_path")):
        with pytest.raises(ParameterError) as e:
            LoRARequest(*args)
        assert e.value.field == field
    with pytest.raises(ParameterError) as e:
        LLM(tiny_model, enable_lora=True, tensor_parallel_size=2)
    assert e.value.field == "enable_lora"
    llm = LLM(tiny_model)
    try:
        with pytest.raises(ParameterError) as e:
            llm.generate("hi", lora_request=LoRARequest("a", 1, "/p"), use_tqdm=False)
        assert e.value.field == "lora_request"
    finally:
        llm.shutdown()


def test_lora_requests_info_names_running_and_waiting_adapters(lora_setup):
    """vllm:lora_requests_info: with one slot, a1 runs while a2's request waits for it."""
    base, a1, a2, vocab = lora_setup
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=4)
        engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, params, lora_request=LoRARequest("a1", 1, a1))
        engine.add_request("y", {"prompt_token_ids": [5, 6, 8]}, params, lora_request=LoRARequest("a2", 2, a2))
        engine.step()
        info = [m for m in engine.get_metrics() if m.name == "vllm:lora_requests_info"]
        assert len(info) == 1
        labels = info[0].labels
        assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"], labels["max_lora"]) == \
            ("a1", "a2", "1")
        while engine.has_unfinished_requests():
            engine.step()
        # The routers' view: max_cpu_loras (default max_loras = 1) adapters, the latest.
        assert engine.core.load().lora.held == ("a2",)
    finally:
        llm.shutdown()
