"""Shared helpers for the actor tests."""

from __future__ import annotations

import asyncio
import functools
import time

from tests.engine.hf_reference import random_prompts

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64}


@functools.cache
def _input_processor(model: str, engine_items: tuple):
    from engine import EngineArgs
    from engine.llm_engine import load_processor

    return load_processor(EngineArgs(model, **dict(engine_items)).create_engine_config())[1]


def engine_request(model: str, prompt, params, request_id: str, engine_kwargs: dict | None = None, **kw):
    """The EngineRequest a front end builds for `prompt` (an InputProcessor of `model` with the
    workers' `engine_kwargs`, run here): what the workers and pd_generate take. `kw`: the
    other arguments of InputProcessor.process (priority, lora_request, ...)."""
    processor = _input_processor(model, tuple(sorted((engine_kwargs or ENGINE).items())))
    return processor.process(prompt, params, request_id, **kw)


async def collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def make_prompt(seed: int = 41, n: int = 40) -> dict:
    return {"prompt_token_ids": random_prompts([n], 1000, seed=seed)[0]}


async def wait_until(fn, what: str, tries: int = 500):
    """Poll a condition on actor state (bounded), yielding to the event loop between tries."""
    for _ in range(tries):
        if await fn():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def assert_no_leaks(ray, store, *workers):
    """Every KV block free, no request left, no live transfer, no unsent export."""
    for load in (report.engine for report in ray.get([w.load.remote() for w in workers])):
        assert load.free_blocks == load.total_blocks, load
        assert load.running == 0 and load.waiting == 0, load
    # A consumer's release is fire-and-forget (it must not block its engine thread): it
    # reaches the store shortly after the request ended there, so wait for it, bounded.
    for _ in range(500):
        if ray.get(store.stats.remote())["live_transfers"] == 0:
            break
        time.sleep(0.01)
    assert ray.get(store.stats.remote())["live_transfers"] == 0, ray.get(store.stats.remote())
    assert sum(ray.get([w.outbox_size.remote() for w in workers])) == 0


async def decode_half(decode, request, first):
    """The decode half of pd_generate, run by hand after a separate prefill call (`request`:
    the whole request, `first`: its prefill's output)."""
    from cluster.pd.split import decode_request

    gen = decode.generate.remote(decode_request(request, first))
    last = None
    async for ref in gen:
        last = await ref
    return last


def transfer_lost_peers(prefill, decode, store):
    """Peers whose prefill's transfer is gone from the store before the decode loads it (its
    lease ran out): the decode replica's load fails the way a real loss would."""
    from cluster.pd.actor_peers import ActorPeers

    class Losing(ActorPeers):
        async def prefill(self, request):
            out = await super().prefill(request)
            await self.store.release.remote(request.kv_transfer_params.transfer_id)
            return out

    return Losing(prefill, decode, store)
