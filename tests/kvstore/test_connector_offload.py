"""The P/D connector and the host KV tier in one engine (engine.kv_offload.MultiConnector):
a decode engine loads each prompt's KV from its producer, keeps it in its host tier, and a
later prompt that missed its pool loads from there; tokens equal Hugging Face's, nothing
leaks, and a failed P/D load still follows the P/D policy."""

from __future__ import annotations

from cluster.pd.split import decode_request, prefill_request
from engine import EngineArgs, SamplingParams
from engine.kv_offload import MultiConnector, OffloadConnector
from engine.llm_engine import LLMEngine
from kvstore.connector import PDConnector
from kvstore.transports import LocalTransport, TransferError
from tests.engine.hf_reference import hf_greedy, random_prompts

BS = 16
TIER_GB = 0.01
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _engine(model, pd_role, transport, replica_id, *rest, **kw):
    config = EngineArgs.from_kwargs(model, max_model_len=256, block_size=BS, kv_offloading_size=TIER_GB,
                                    **kw).create_engine_config()

    def factory(side):
        return PDConnector(side, pd_role, transport, replica_id, BS, *rest)

    return LLMEngine(config, factory)


def _run(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _pd(prefill, decode, rid, prompt):
    req = prefill.process({"prompt_token_ids": prompt}, GREEDY, rid)
    prefill.add(prefill_request(req))
    first = _run(prefill, rid)
    decode.add(decode_request(req, first))
    return list(first.outputs[0].token_ids) + list(_run(decode, rid).outputs[0].token_ids)


def _sides(engine) -> tuple[PDConnector, OffloadConnector]:
    multi = engine.core.executor.worker.kv_connector
    assert isinstance(multi, MultiConnector)
    return multi.connectors[0], multi.connectors[1]


def _assert_no_leaks(*engines, transport):
    for e in engines:
        kv = e.core.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert not e.has_unfinished_requests()
    assert transport.live_transfers == 0


def test_pd_decode_keeps_loaded_prompts_in_its_host_tier_and_serves_them_again(tiny_model):
    transport = LocalTransport()
    prefill = _engine(tiny_model, "producer", transport, "p0")
    # A pool of 24 blocks: each 150-token prompt pushes the previous one out of it.
    decode = _engine(tiny_model, "consumer", transport, "d0", num_kv_blocks=24)
    prompts = random_prompts([150, 140, 160], 1000, seed=41)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    assert [_pd(prefill, decode, f"r{i}", p) for i, p in enumerate(prompts)] == expected
    pd_side, tier = _sides(decode)
    assert pd_side.stats["loads"] == len(prompts) and tier.stats["host_stores"] > 0
    # The same prompts asked of the decode engine directly: they missed its pool, the host
    # tier has them.
    again = []
    for i, p in enumerate(prompts):
        decode.add_request(f"c{i}", {"prompt_token_ids": p}, GREEDY)
        out = _run(decode, f"c{i}")
        again.append(list(out.outputs[0].token_ids))
        assert out.num_cached_tokens == (len(p) - 1) // BS * BS
    assert [a[:MAX_NEW] for a in again] == expected
    assert tier.stats["host_hit_tokens"] > 0 and tier.stats["host_refused"] == 0
    _assert_no_leaks(prefill, decode, transport=transport)


class FailingTransport(LocalTransport):
    def fetch_async(self, params, on_done):
        on_done(TransferError("producer is gone"))


def test_a_failed_pd_load_follows_the_pd_policy_not_the_tiers(tiny_model):
    transport = FailingTransport()
    prefill = _engine(tiny_model, "producer", transport, "p0")
    decode = _engine(tiny_model, "consumer", transport, "d0", "fail")
    prompt = random_prompts([40], 1000, seed=42)[0]
    req = prefill.process({"prompt_token_ids": prompt}, GREEDY, "r")
    prefill.add(prefill_request(req))
    first = _run(prefill, "r")
    decode.add(decode_request(req, first))
    assert _run(decode, "r").outputs[0].finish_reason == "error"
    transport.release(first.kv_transfer_params)
    _assert_no_leaks(prefill, decode, transport=transport)


def test_a_refused_host_block_is_recomputed_even_where_pd_loads_fail_requests(tiny_model):
    transport = LocalTransport()
    decode = _engine(tiny_model, "consumer", transport, "d0", "fail", num_kv_blocks=24)
    prompts = random_prompts([150, 140, 160], 1000, seed=43)
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)

    def ask(tag):
        outs = []
        for i, p in enumerate(prompts):
            decode.add_request(f"{tag}{i}", {"prompt_token_ids": p}, GREEDY)
            outs.append(_run(decode, f"{tag}{i}"))
        return outs

    assert [list(o.outputs[0].token_ids) for o in ask("a")] == expected
    _, tier = _sides(decode)
    for block in tier.pool._blocks.values():
        block.data.view(-1)[0] += 1.0
    again = ask("b")
    assert [o.outputs[0].finish_reason for o in again] == ["length"] * len(prompts)
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert tier.stats["host_refused"] > 0
    _assert_no_leaks(decode, transport=transport)
