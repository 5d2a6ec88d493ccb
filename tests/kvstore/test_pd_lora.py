"""P/D with LoRA adapters, two in-process engines: both sides run the request's adapter, the
transfer names it and the decode side loads (never recomputes) the prompt's KV; greedy tokens
equal PEFT's. A transfer made with another adapter is never loaded: decode recomputes."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.pd.split import decode_request, prefill_request
from engine import SamplingParams
from engine.lora import LoRARequest
from kvstore.transports import LocalTransport
from tests.engine.hf_reference import random_prompts
from tests.engine.lora_factory import make_peft_adapter, peft_greedy
from tests.kvstore.test_connector_engine import _assert_no_leaks, _engine, _run, _worker_side

N = 10
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd-adapters")
    a1 = make_peft_adapter(tiny_model, str(d / "a1"), 8, ["q_proj", "v_proj"], seed=11)
    a2 = make_peft_adapter(tiny_model, str(d / "a2"), 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], seed=12, scale=0.5)
    return LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)


@pytest.fixture
def pd_pair(tiny_model):
    transport = LocalTransport()
    return _engine(tiny_model, ("producer", transport, "p0"), **LORA), \
        _engine(tiny_model, ("consumer", transport, "d0"), **LORA), transport


def _prefill(p, rid, prompt, params, lora):
    """(the request, the prefill's output) of `prompt` run with adapter `lora` (None: the base)."""
    req = p.process({"prompt_token_ids": prompt}, params, rid, lora_request=lora)
    p.add(prefill_request(req))
    return req, _run(p, rid)


def test_pd_runs_each_requests_adapter_on_both_sides_and_loads_its_kv(pd_pair, adapters, tiny_model):
    p, d, transport = pd_pair
    a1, a2 = adapters
    prompts = random_prompts([9, 33, 20], 1000, seed=31)
    params = SamplingParams(temperature=0, max_tokens=N)
    for i, (prompt, lora) in enumerate(zip(prompts, (a1, a2, None))):
        req, first = _prefill(p, f"r{i}", prompt, params, lora)
        assert first.kv_transfer_params.lora_name == (lora.lora_name if lora else None)
        token = first.outputs[0].token_ids[0]
        rest = decode_request(req, first)
        assert rest.lora_request == lora  # decode runs the adapter the prefill ran
        d.add(rest)
        got = [token, *_run(d, f"r{i}").outputs[0].token_ids]
        assert got == peft_greedy(tiny_model, lora.lora_path if lora else None, [prompt], N)[0]
    assert _worker_side(d).stats["loads"] == 3  # every prompt's KV was loaded, none recomputed
    _assert_no_leaks(p, d, transport=transport)


def test_kv_made_with_another_adapter_is_recomputed_not_loaded(pd_pair, adapters, tiny_model):
    p, d, transport = pd_pair
    a1, a2 = adapters
    prompt = random_prompts([40], 1000, seed=32)[0]
    params = SamplingParams(temperature=0, max_tokens=N)
    req, first = _prefill(p, "r", prompt, params, a1)
    token = first.outputs[0].token_ids[0]
    # The decode request names a2: loading a1's KV would answer with neither adapter.
    d.add(dataclasses.replace(decode_request(req, first), lora_request=a2))
    rest = list(_run(d, "r").outputs[0].token_ids)
    assert rest == peft_greedy(tiny_model, a2.lora_path, [prompt + [token]], N - 1)[0]
    assert _worker_side(d).stats["loads"] == 0
    _assert_no_leaks(p, d, transport=transport)
