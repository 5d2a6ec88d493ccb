"""P/D through the connector with two in-process engines (no Ray): the decode engine loads
the prompt KV instead of recomputing it, tokens equal the colocated run, nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.pd.split import decode_request, needs_decode, prefill_request
from engine import EngineArgs, SamplingParams
from engine.kv_connector import KVConnectorRole
from engine.kv_transfer_params import KVTransferParams
from engine.llm_engine import LLMEngine
from kvstore.connector import PDConnector
from kvstore.transports import LocalTransport, TransferError
from tests.engine.hf_reference import hf_greedy, random_prompts

BS = 16


def _engine(model, connector=None, **kw):
    """An engine with both sides of `connector` (a PDConnector argument tuple), or none."""
    config = EngineArgs.from_kwargs(model, max_model_len=256, block_size=BS, **kw).create_engine_config()
    factory = None
    if connector is not None:
        pd_role, transport, replica_id, *rest = connector

        def factory(side):
            return PDConnector(side, pd_role, transport, replica_id, BS, *rest)

    return LLMEngine(config, factory)


def _worker_side(engine) -> PDConnector:
    return engine.core.executor.worker.kv_connector


def _run(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _pd(prefill, decode, rid, prompt, params):
    req = prefill.process({"prompt_token_ids": prompt}, params, rid)
    prefill.add(prefill_request(req))
    first = _run(prefill, rid)
    tokens = list(first.outputs[0].token_ids)
    if not needs_decode(first.outputs[0].finish_reason, req):
        return tokens, first
    decode.add(decode_request(req, first))
    last = _run(decode, rid)
    return tokens + list(last.outputs[0].token_ids), last


@pytest.fixture
def pd_pair(tiny_model):
    transport = LocalTransport()
    p = _engine(tiny_model, ("producer", transport, "p0"))
    d = _engine(tiny_model, ("consumer", transport, "d0"))
    return p, d, transport


def _assert_no_leaks(*engines, transport=None):
    for e in engines:
        kv = e.core.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert not e.has_unfinished_requests()
    if transport is not None:
        assert transport.live_transfers == 0


@pytest.mark.gpu
def test_pd_greedy_equals_colocated_and_transformers(pd_pair, tiny_model):
    p, d, transport = pd_pair
    colocated = _engine(tiny_model)
    prompts = random_prompts([5, 16, 33, 70], 1000, seed=21)
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = hf_greedy(tiny_model, prompts, 12)
    for i, prompt in enumerate(prompts):
        got, _ = _pd(p, d, f"r{i}", prompt, params)
        colocated.add_request(f"c{i}", {"prompt_token_ids": prompt}, params)
        assert got == list(_run(colocated, f"c{i}").outputs[0].token_ids) == ref[i]
    _assert_no_leaks(p, d, transport=transport)


@pytest.mark.gpu
def test_pd_seeded_sampling_and_text_equal_colocated(pd_pair, tiny_model):
    p, d, transport = pd_pair
    colocated = _engine(tiny_model)
    prompt = random_prompts([21], 1000, seed=27)[0]
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True)
        got, last = _pd(p, d, f"s{seed}", prompt, params)
        colocated.add_request(f"c{seed}", {"prompt_token_ids": prompt}, params)
        ref = _run(colocated, f"c{seed}").outputs[0]
        assert got == list(ref.token_ids)
    _assert_no_leaks(p, d, transport=transport)


@pytest.mark.gpu
def test_decode_does_not_recompute_the_prompt(pd_pair):
    p, d, _ = pd_pair
    prompt = random_prompts([40], 1000, seed=22)[0]
    scheduled = []
    runner = d.core.executor.worker.runner
    original = runner.execute_model

    def spy(so):
        scheduled.append(dict(so.num_scheduled_tokens))
        return original(so)

    runner.execute_model = spy
    _pd(p, d, "r", prompt, SamplingParams(temperature=0, max_tokens=4))
    first_step = next(s for s in scheduled if s)
    assert first_step == {"r": 1}  # only the first generated token, never the 40-token prompt
    assert _worker_side(p).stats["exports"] == 1 and _worker_side(d).stats["loads"] == 1


def test_single_token_request_never_reaches_decode(pd_pair):
    p, d, transport = pd_pair
    tokens, out = _pd(p, d, "r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1))
    assert len(tokens) == 1 and out.outputs[0].finish_reason == "length"
    # The orchestrator releases the unused transfer.
    transport.release(out.kv_transfer_params)
    _assert_no_leaks(p, d, transport=transport)


class FailingTransport(LocalTransport):
    def fetch_async(self, params, on_done):
        on_done(TransferError("producer is gone"))


def _pd_with_failing_fetch(tiny_model, policy):
    transport = FailingTransport()
    p = _engine(tiny_model, ("producer", transport, "p0"))
    d = _engine(tiny_model, ("consumer", transport, "d0", policy))
    return p, d, transport


def test_load_failure_with_fail_policy_is_an_explicit_error(tiny_model):
    p, d, transport = _pd_with_failing_fetch(tiny_model, "fail")
    prompt = random_prompts([30], 1000, seed=23)[0]
    _, out = _pd(p, d, "r", prompt, SamplingParams(temperature=0, max_tokens=6))
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert "KV load failed" in out.outputs[0].stop_reason
    _assert_no_leaks(p, d, transport=transport)


def test_a_decode_computed_locally_gives_the_colocated_tokens_and_text_and_releases_nothing(pd_pair, tiny_model):
    """A decode request resubmitted to another replica (cluster.replica.front_streams) carries
    `computed_locally()` params: no load, and the same continuation as the decode that loads
    the KV (seeded sampling, tokens, text, logprobs), whose tokens equal the colocated run."""
    p, d, transport = pd_pair
    colocated = _engine(tiny_model)
    prompt = random_prompts([21], 1000, seed=28)[0]
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True, logprobs=2)
        req = p.process({"prompt_token_ids": prompt}, params, f"p{seed}")
        p.add(prefill_request(req))
        first = _run(p, f"p{seed}")
        rest = decode_request(req, first)
        kv = rest.kv_transfer_params
        d.add(dataclasses.replace(rest, request_id=f"local{seed}", kv_transfer_params=kv.computed_locally()))
        local = _run(d, f"local{seed}").outputs[0]
        assert transport.live_transfers == 1 and _worker_side(d).stats["loads"] == seed - 1  # untouched
        d.add(dataclasses.replace(rest, request_id=f"loaded{seed}"))
        loaded = _run(d, f"loaded{seed}").outputs[0]
        assert _worker_side(d).stats["loads"] == seed and transport.live_transfers == 0
        assert (local.token_ids, local.text) == (loaded.token_ids, loaded.text)
        assert [sorted(p) for p in local.logprobs] == [sorted(p) for p in loaded.logprobs]
        colocated.add_request(f"c{seed}", {"prompt_token_ids": prompt}, params)
        ref = _run(colocated, f"c{seed}").outputs[0]
        assert list(first.outputs[0].token_ids) + list(local.token_ids) == list(ref.token_ids)
    _assert_no_leaks(p, d, transport=transport)


def test_load_failure_with_recompute_policy_gives_the_same_tokens(tiny_model):
    p, d, transport = _pd_with_failing_fetch(tiny_model, "recompute")
    prompt = random_prompts([30], 1000, seed=24)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    tokens, out = _pd(p, d, "r", prompt, params)
    assert out.outputs[0].finish_reason == "length"
    assert tokens == hf_greedy(tiny_model, [prompt], 6)[0]
    _assert_no_leaks(p, d, transport=transport)


def test_abort_while_waiting_for_kv_frees_blocks_and_transfer(tiny_model):
    class NeverArrives(LocalTransport):
        def fetch_async(self, params, on_done):
            pass  # in flight forever

    transport = NeverArrives()
    p = _engine(tiny_model, ("producer", transport, "p0"))
    d = _engine(tiny_model, ("consumer", transport, "d0"))
    prompt = random_prompts([30], 1000, seed=25)[0]
    req = p.process({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5), "r")
    p.add(dataclasses.replace(prefill_request(req), kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    first = _run(p, "r")
    rest = decode_request(req, first)
    assert rest.max_tokens == 4  # the decode half asks for the 4 tokens left, as before the port
    d.add(rest)
    d.step()
    d.step()
    assert d.core.kv_cache_manager.get_num_free_blocks() < d.core.kv_cache_manager.num_blocks
    d.abort_request("r")
    d.step()  # the engine's next step tells the worker side, which releases the transfer
    _assert_no_leaks(p, d, transport=transport)


def test_local_prefix_hit_covering_the_transfer_skips_the_load(pd_pair, tiny_model):
    p, d, transport = pd_pair
    prompt = random_prompts([32], 1000, seed=26)[0]  # block aligned: a full local hit
    params = SamplingParams(temperature=0, max_tokens=3)
    first_run, _ = _pd(p, d, "a", prompt, params)
    loads = _worker_side(d).stats["loads"]
    second_run, _ = _pd(p, d, "b", prompt, params)
    assert second_run == first_run
    assert _worker_side(d).stats["loads"] == loads  # served from d's own prefix cache
    _assert_no_leaks(p, d, transport=transport)


def test_invalid_connector_settings_are_rejected():
    with pytest.raises(ValueError, match="role"):
        PDConnector(KVConnectorRole.SCHEDULER, "server", LocalTransport(), "x", 16)
    with pytest.raises(ValueError, match="load_failure_policy"):
        PDConnector(KVConnectorRole.WORKER, "consumer", LocalTransport(), "x", 16, load_failure_policy="retry")


def _merged_text(prefill, decode, rid, prompt, params) -> tuple[str, str | None]:
    """The text a P/D client receives (prefill's emitted text + decode's deltas) and the
    finish reason, as cluster.pd.flow.pd_flow merges them."""
    req = prefill.process({"prompt_token_ids": prompt}, params, rid)
    prefill.add(prefill_request(req))
    first = _run(prefill, rid)
    text = first.delta_text
    if not needs_decode(first.outputs[0].finish_reason, req):
        return text, first.outputs[0].finish_reason
    decode.add(decode_request(req, first))
    while True:
        for out in decode.step():
            if out.request_id == rid:
                text += out.delta_text
                if out.finished:
                    return text, out.outputs[0].finish_reason


def test_stop_string_spanning_the_first_token_is_honoured_as_colocated(pd_pair, tiny_model):
    """A stop string that starts in the prefill's token and ends in decode's must cut the
    text exactly where a colocated engine cuts it (and never reach the client)."""
    p, d, transport = pd_pair
    colocated = _engine(tiny_model)
    checked = 0
    for i, prompt in enumerate(random_prompts([5, 9, 14, 20, 27, 33], 1000, seed=91)):
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        colocated.add_request(f"c{i}", {"prompt_token_ids": prompt}, plain)
        ids = _run(colocated, f"c{i}").outputs[0].token_ids
        tok = colocated.tokenizer
        a, ab = tok.decode(ids[:1]), tok.decode(ids[:2])
        if not a or len(ab) <= len(a) or "\ufffd" in ab:
            continue
        stop = ab[len(a) - 1: len(a) + 1]  # last char of token 1 + first char of token 2
        if stop in a:
            continue
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        colocated.add_request(f"s{i}", {"prompt_token_ids": prompt}, params)
        ref = _run(colocated, f"s{i}").outputs[0]
        text, finish = _merged_text(p, d, f"pd{i}", prompt, params)
        assert (text, finish) == (ref.text, ref.finish_reason), (stop, text, ref.text)
        assert stop not in text and finish == "stop"
        checked += 1
    assert checked >= 2, "too few prompts gave a first token and a spanning stop string"
    _assert_no_leaks(p, d, transport=transport)


def test_the_requester_can_name_the_transfer(pd_pair, tiny_model):
    p, d, transport = pd_pair
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = random_prompts([12], 1000, seed=5)[0]
    p.add(prefill_request(p.process({"prompt_token_ids": prompt}, params, "named"), transfer_id="chosen-id"))
    first = _run(p, "named")
    assert first.kv_transfer_params.transfer_id == "chosen-id"
    transport.release(first.kv_transfer_params)
    _assert_no_leaks(p, transport=transport)


def test_speculating_decode_engine_keeps_greedy_tokens_and_accepts_drafts(tiny_model):
    """P/D with n-gram speculation on the decode side only (as actors/worker.py configures
    the roles): tokens equal transformers', drafts are accepted, nothing leaks."""
    transport = LocalTransport()
    p = _engine(tiny_model, ("producer", transport, "p0"))
    d = _engine(tiny_model, ("consumer", transport, "d0"),
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    base = random_prompts([12, 7], 1000, seed=5)
    prompts = [base[0] * 4, base[1] * 6]  # repetitive: the random model repeats itself too
    params = SamplingParams(temperature=0, max_tokens=20)
    ref = hf_greedy(tiny_model, prompts, 20)
    for i, prompt in enumerate(prompts):
        got, _ = _pd(p, d, f"r{i}", prompt, params)
        assert got == ref[i]
    assert d.core.load().spec_decode.num_accepted_tokens > 0
    assert p.core.load().spec_decode is None  # a prefill engine never speculates
    _assert_no_leaks(p, d, transport=transport)


def test_pd_on_a_hybrid_sliding_window_model_equals_transformers_and_ships_each_group(model_factory):
    """Gemma 2 (window layers in a group of their own): the prefill exports both groups'
    KV, the decode side keeps only the window's blocks of its window layers, and the tokens
    are transformers'."""
    model = model_factory("gemma2")  # window 16 on layer 0
    transport = LocalTransport()
    p = _engine(model, ("producer", transport, "p0"), max_num_batched_tokens=32, long_prefill_token_threshold=32)
    d = _engine(model, ("consumer", transport, "d0"))
    for e in (p, d):
        assert e.core.kv_cache_manager.window_group is not None
    prompts = random_prompts([5, 40, 150], 1000, seed=23)
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = hf_greedy(model, prompts, 12)
    window = d.core.kv_cache_manager.window_group
    for i, prompt in enumerate(prompts):
        got, _ = _pd(p, d, f"r{i}", prompt, params)
        assert got == ref[i]
    assert _worker_side(d).stats["loads"] == 3
    _assert_no_leaks(p, d, transport=transport)
    for e in (p, d):
        group = e.core.kv_cache_manager.window_group
        assert group.pool.get_num_free_blocks() == group.pool.num_usable_blocks
    # A 150-token prompt decoded for 11 tokens held at most the window's blocks on the decode
    # side: its cached window blocks are the last two of the prompt, no earlier ones.
    cached = {b.block_id for b in window.pool.cached_block_hash_to_block.values()}
    assert 0 < len(cached) <= 2 + 2 + 1
