"""The shared KV tier (kvstore.shared_tier) between two engines that share one KV store actor:
a prompt engine A computed is loaded by engine B instead of computed, with greedy tokens equal
to A's and Hugging Face's; a corrupt block and a dead store both end in a recompute with the
same tokens; no engine block leaks; a leaving replica's blocks are copied by the store and
outlive it."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from engine import EngineArgs, SamplingParams
from engine.errors import ParameterError
from engine.kv_cache.events import SHARED
from engine.kv_offload.host_pool import checksum
from engine.llm_engine import LLMEngine
from kvstore.shared_tier import SharedTierConnector, with_shared_tier
from kvstore.store_actor import ADOPTED, create_store
from tests.engine.hf_reference import hf_greedy, random_prompts

BS = 16
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
TIER_GB = 0.01
PROMPT_LEN = 150  # 9 full blocks past which one token is computed
SHARED_TOKENS = (PROMPT_LEN - 1) // BS * BS


def _engine(model: str, store, replica_id: str) -> LLMEngine:
    config = EngineArgs.from_kwargs(model, max_model_len=256, block_size=BS, kv_shared_tier_size=TIER_GB,
                                    kv_events_config={"enable_kv_cache_events": True}).create_engine_config()
    return LLMEngine(config, with_shared_tier(config, store, replica_id, None))


def _generate(engine: LLMEngine, prompt: list[int], rid: str, bound_s: float = 60.0, steps: list | None = None):
    """`rid`'s finished output, driven as LLM.generate drives its engine; `steps` gets one
    entry per step() call."""
    engine.add(engine.process({"prompt_token_ids": prompt}, GREEDY, rid))
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        outputs = engine.step()
        if steps is not None:
            steps.append(len(outputs))
        if not outputs:
            engine.wait_while_waiting()
        for out in outputs:
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish in {bound_s} s")


def _worker(engine: LLMEngine) -> SharedTierConnector:
    return engine.core.executor.worker.kv_connector


def _mirror(engine: LLMEngine):
    return engine.core.scheduler.remote_kv.connector.index


def _wait_listed(engine: LLMEngine, n: int, bound_s: float = 30.0) -> None:
    """Until `engine`'s mirror lists `n` blocks (the other engine's stores have landed)."""
    deadline = time.monotonic() + bound_s
    while len(_mirror(engine)) < n:
        assert time.monotonic() < deadline, f"the mirror lists {len(_mirror(engine))} of {n} blocks"
        time.sleep(0.05)


def _assert_no_leaks(*engines: LLMEngine) -> None:
    for e in engines:
        kv = e.core.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert not e.has_unfinished_requests()


@pytest.fixture
def store(ray_local):
    store = create_store()
    yield store
    ray_local.kill(store)


@pytest.fixture(scope="module")
def prompt_and_expected(tiny_model):
    [prompt] = random_prompts([PROMPT_LEN], 1000, seed=7)
    return prompt, hf_greedy(tiny_model, [prompt], MAX_NEW)[0]


def test_a_prompt_computed_on_one_engine_is_loaded_by_another_with_equal_tokens(tiny_model, store,
                                                                                prompt_and_expected):
    prompt, expected = prompt_and_expected
    a, b = _engine(tiny_model, store, "A"), _engine(tiny_model, store, "B")
    out_a = _generate(a, prompt, "a")
    assert out_a.num_cached_tokens == 0
    _wait_listed(b, SHARED_TOKENS // BS)
    out_b = _generate(b, prompt, "b")
    assert out_b.num_cached_tokens == SHARED_TOKENS
    assert list(out_b.outputs[0].token_ids) == list(out_a.outputs[0].token_ids) == list(expected)
    stats = _worker(b).transfer_stats()
    assert stats["shared_loads"] == SHARED_TOKENS // BS and stats["shared_load_failures"] == 0
    assert _worker(a).transfer_stats()["shared_stores"] >= SHARED_TOKENS // BS
    # B tells a KV-aware router what the tier holds (SHARED medium), as its snapshot does.
    assert len(b.core.kv_snapshot().held[SHARED]) >= SHARED_TOKENS // BS
    _assert_no_leaks(a, b)


def test_an_engine_waiting_for_a_slow_fetch_sleeps_until_woken_instead_of_stepping(tiny_model, store,
                                                                                   prompt_and_expected,
                                                                                   monkeypatch):
    """A step loop that never pauses would hold the GIL against the fetching thread (measured
    on a 2-core machine: the fetch took 0.2 s instead of 0.01 s, thousands of empty steps)."""
    prompt, expected = prompt_and_expected
    a, b = _engine(tiny_model, store, "A"), _engine(tiny_model, store, "B")
    _generate(a, prompt, "a")
    _wait_listed(b, SHARED_TOKENS // BS)
    fetch = SharedTierConnector._fetch_blocks
    delay_s = 0.3  # a slow network, not a synchronisation: the engine must wait it out either way

    def slow_fetch(self, spec):
        time.sleep(delay_s)
        return fetch(self, spec)

    monkeypatch.setattr(SharedTierConnector, "_fetch_blocks", slow_fetch)
    steps: list[int] = []
    start = time.monotonic()
    out_b = _generate(b, prompt, "b", steps=steps)
    assert time.monotonic() - start >= delay_s
    assert list(out_b.outputs[0].token_ids) == list(expected) and out_b.num_cached_tokens == SHARED_TOKENS
    # Woken when the blocks land (or polled at the 50 ms bound): a handful of empty steps.
    assert steps.count(0) <= delay_s / 0.05 + 3, f"{steps.count(0)} empty steps while the fetch ran"
    _assert_no_leaks(a, b)


def test_a_corrupt_shared_block_is_refused_and_the_prompt_recomputed(tiny_model, store, ray_local,
                                                                     prompt_and_expected):
    import torch

    prompt, expected = prompt_and_expected
    a, b = _engine(tiny_model, store, "A"), _engine(tiny_model, store, "B")
    _generate(a, prompt, "a")
    _wait_listed(b, SHARED_TOKENS // BS)
    # One of the prompt's blocks now holds other bytes under its old checksum.
    victim = _mirror(b).hashes()[0]
    [entry] = ray_local.get(store.shared_get.remote([victim]))
    good = ray_local.get(entry["refs"][0])
    ray_local.get(store.shared_drop.remote([victim]))
    ray_local.get(store.shared_put.remote(victim, [ray_local.put(torch.zeros_like(good))], entry["nbytes"],
                                          entry["crc32"], entry["shape"], entry["dtype"], "A"))
    # B's mirror past both changes (between them it would match only the blocks before the victim).
    version = ray_local.get(store.shared_stats.remote())["version"]
    deadline = time.monotonic() + 30
    while _mirror(b).version < version:
        assert time.monotonic() < deadline, "B's mirror did not follow the directory"
        time.sleep(0.05)
    before = b.core.num_scheduled_tokens
    out_b = _generate(b, prompt, "b")
    assert list(out_b.outputs[0].token_ids) == list(expected)
    # Computed, not loaded (num_cached_tokens counts what its first admission expected to load).
    assert b.core.num_scheduled_tokens - before >= PROMPT_LEN
    stats = _worker(b).transfer_stats()
    assert stats["shared_refused"] == 1 and stats["shared_loads"] == 0
    # The corrupt copy is gone; the block is held again as B computed it.
    [now] = ray_local.get(store.shared_get.remote([victim]))
    assert now is None or (now["owner"] == "B" and bool((ray_local.get(now["refs"][0]) == good).all()))
    _assert_no_leaks(a, b)


def test_a_dead_store_ends_in_a_recompute_with_equal_tokens(tiny_model, store, ray_local, prompt_and_expected):
    prompt, expected = prompt_and_expected
    a, b = _engine(tiny_model, store, "A"), _engine(tiny_model, store, "B")
    _generate(a, prompt, "a")
    _wait_listed(b, SHARED_TOKENS // BS)
    ray_local.kill(store)
    before = b.core.num_scheduled_tokens
    out_b = _generate(b, prompt, "b")
    assert list(out_b.outputs[0].token_ids) == list(expected)
    assert b.core.num_scheduled_tokens - before >= PROMPT_LEN  # computed: nothing came from the tier
    # Its stores go nowhere and fail nothing: a second request on B hits its own pool.
    again = _generate(b, prompt, "b2")
    assert list(again.outputs[0].token_ids) == list(expected) and again.num_cached_tokens == SHARED_TOKENS
    _assert_no_leaks(a, b)


def test_a_request_aborted_while_its_blocks_are_fetched_gets_nothing_written(tiny_model, store,
                                                                            prompt_and_expected):
    prompt, expected = prompt_and_expected
    a, b = _engine(tiny_model, store, "A"), _engine(tiny_model, store, "B")
    _generate(a, prompt, "a")
    _wait_listed(b, SHARED_TOKENS // BS)
    b.add(b.process({"prompt_token_ids": prompt}, GREEDY, "gone"))
    b.step()  # admitted: its load starts
    assert _worker(b)._in_flight or _worker(b)._fetched
    b.abort_request("gone")
    b.step()  # the abandoned load is forgotten before anything is written
    time.sleep(0.5)  # a fetch still running finishes into nothing
    b.step()
    assert not _worker(b)._in_flight and not _worker(b)._fetched
    assert _worker(b).transfer_stats()["shared_loads"] == 0
    _assert_no_leaks(b)
    out = _generate(b, prompt, "again")  # the blocks it held are free and whole
    assert list(out.outputs[0].token_ids) == list(expected)
    _assert_no_leaks(a, b)


def test_an_engine_with_both_tiers_asks_its_host_tier_first(tiny_model, store, prompt_and_expected):
    from engine.kv_offload import MultiConnector, OffloadConnector

    prompt, expected = prompt_and_expected
    config = EngineArgs.from_kwargs(tiny_model, max_model_len=256, block_size=BS, kv_shared_tier_size=TIER_GB,
                                    kv_offloading_size=TIER_GB).create_engine_config()
    engine = LLMEngine(config, with_shared_tier(config, store, "A", None))
    multi = engine.core.executor.worker.kv_connector
    assert isinstance(multi, MultiConnector)
    assert [type(c) for c in multi.connectors] == [OffloadConnector, SharedTierConnector]
    assert list(_generate(engine, prompt, "a").outputs[0].token_ids) == list(expected)
    _assert_no_leaks(engine)


def test_a_tier_too_small_for_one_block_is_refused_naming_the_field(tiny_model, store):
    config = EngineArgs.from_kwargs(tiny_model, max_model_len=256, block_size=BS,
                                    kv_shared_tier_size=1e-9).create_engine_config()
    with pytest.raises(ParameterError, match="kv_shared_tier_size"):
        with_shared_tier(config, store, "A", None)


def test_an_engine_without_a_cluster_runs_without_the_tier_and_says_so(tiny_model, caplog):
    from engine import LLM

    with caplog.at_level("WARNING", logger="engine.core"):
        llm = LLM(tiny_model, max_model_len=256, block_size=BS, kv_shared_tier_size=TIER_GB)
    assert "kv_shared_tier_size=0.01 is ignored" in caplog.text
    assert llm.engine.core.executor.worker.kv_connector is None


@ray.remote(num_cpus=0)
class _Sharer:
    """A stand-in replica process: it owns the objects of the blocks it shares."""

    def share(self, store, block_hash: bytes, data: torch.Tensor, owner: str) -> str:
        ref = ray.put(data)
        ray.get(store.shared_put.remote(block_hash, [ref], data.numel() * 4, checksum(data),
                                        tuple(data.shape), str(data.dtype), owner))
        return ref.hex()


def _shared_by_a_process(store):
    ray.get(store.shared_open.remote(1 << 22))
    data = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)  # in plasma: not inlined
    sharer = _Sharer.remote()
    return sharer, data, ray.get(sharer.share.remote(store, b"h1", data, "R1"))


def test_a_leaving_replicas_blocks_are_adopted_by_the_store_and_outlive_it(store, ray_local):
    sharer, data, put_ref = _shared_by_a_process(store)
    assert ray.get(store.shared_adopt.remote("R1")) == {"adopted": 1, "dropped": 0}
    ray_local.kill(sharer)
    with pytest.raises(ray.exceptions.RayActorError):  # the kill is asynchronous: until it is done
        ray.get(sharer.share.remote(store, b"h2", data, "R1"), timeout=60)
    [found] = ray.get(store.shared_get.remote([b"h1"]))
    # A copy the store owns (Ray finds an object through its owner's process), with equal bytes.
    assert found is not None and found["owner"] == ADOPTED and found["refs"][0].hex() != put_ref
    assert torch.equal(ray.get(found["refs"][0], timeout=30), data)
    assert ray.get(store.shared_drop_owner.remote("R1")) == 0  # nothing of it is left to drop


def test_blocks_the_store_cannot_adopt_in_time_are_dropped(store, ray_local):
    sharer, _, _ = _shared_by_a_process(store)
    assert ray.get(store.shared_adopt.remote("R1", 0.0)) == {"adopted": 0, "dropped": 1}
    assert ray.get(store.shared_get.remote([b"h1"])) == [None]
    ray_local.kill(sharer)
