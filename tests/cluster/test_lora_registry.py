"""cluster.http.lora: --lora-modules parsing, name resolution (404 for an unknown model), and
unloading that waits for the adapter's requests (bounded) or answers 409."""

from __future__ import annotations

import asyncio

import pytest

from cluster.http.errors import OpenAIError
from cluster.http.lora import LoRAModule, LoRARegistry
from engine.errors import ParameterError


def _registry(**kw) -> LoRARegistry:
    checked = []
    reg = LoRARegistry("base", checked.append, **kw)
    reg.checked = checked
    return reg


def test_lora_modules_take_vllms_two_forms_and_refuse_others():
    assert LoRAModule.parse("sql=/a/sql") == LoRAModule("sql", "/a/sql")
    assert LoRAModule.parse('{"name": "chat", "path": "/a/c", "base_model_name": "m"}') == LoRAModule("chat", "/a/c", "m")
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', "{not json"):
        with pytest.raises(ParameterError) as e:
            LoRAModule.parse(bad)
        assert e.value.field == "lora_modules"


def test_each_adapter_is_checked_and_gets_its_own_id():
    reg = _registry()
    a, b = reg.add("a", "/p/a"), reg.add("b", "/p/b")
    assert (a.lora_int_id, b.lora_int_id) == (1, 2) and reg.checked == [a, b]
    assert reg.resolve("a") is a and reg.resolve("base") is None
    with pytest.raises(OpenAIError) as e:
        reg.resolve("c")
    assert e.value.status == 404 and "`c` does not exist" in e.value.message
    for name in ("a", "base"):
        with pytest.raises(ParameterError) as e:
            reg.add(name, "/p/x")
        assert e.value.field == "lora_name"
    listed = reg.models(0, 128)
    assert [(m.id, m.parent, m.root) for m in listed] == [("a", "base", "/p/a"), ("b", "base", "/p/b")]


def test_a_bad_adapter_is_not_registered():
    def check(request):
        raise ParameterError("max_lora_rank", "too big")

    reg = LoRARegistry("base", check)
    with pytest.raises(ParameterError):
        reg.add("a", "/p/a")
    with pytest.raises(OpenAIError):
        reg.resolve("a")


def test_unload_waits_for_the_adapters_requests_then_removes_it():
    async def main():
        reg = _registry(unload_wait_s=5)
        a = reg.add("a", "/p/a")
        running, release = asyncio.Event(), asyncio.Event()

        async def request():
            with reg.using(a):
                running.set()
                await release.wait()

        task = asyncio.create_task(request())
        await asyncio.wait_for(running.wait(), 5)  # the request runs, counted as a user of `a`
        unload = asyncio.create_task(reg.unload("a"))
        # Its first step takes `a` off the table, then it can only wait for the request, which
        # waits for `release`: still pending after any number of loop turns.
        done, _ = await asyncio.wait({unload}, timeout=0.2)
        assert not done and not reg.knows("a")
        with pytest.raises(OpenAIError):  # new requests are refused while it drains
            reg.resolve("a")
        release.set()
        await asyncio.wait_for(unload, 5)
        await task
        b = reg.add("a", "/p/a2")  # the name is free again, with a new id
        assert b.lora_int_id == 2

    asyncio.run(main())


def test_unload_of_a_busy_adapter_is_a_409_after_the_bound_and_keeps_it():
    async def main():
        reg = _registry(unload_wait_s=0.05)
        a = reg.add("a", "/p/a")
        with reg.using(a):
            with pytest.raises(OpenAIError) as e:
                await reg.unload("a")
            assert e.value.status == 409
        assert reg.resolve("a") is a
        with pytest.raises(OpenAIError) as e:
            await reg.unload("missing")
        assert e.value.status == 404

    asyncio.run(main())


def test_a_replica_follows_adapters_loaded_and_unloaded_on_others():
    from cluster.http.lora import LoRAFollower

    async def main():
        reg = _registry()
        a = reg.add("a", "/p/a")
        table = {"b": "/p/b"}
        fetched = []

        async def fetch():
            fetched.append(dict(table))
            return dict(table)

        follower = LoRAFollower(reg, fetch, period_s=3600)
        await follower.before("b")  # unknown here: one refresh before answering
        assert reg.resolve("b").lora_path == "/p/b" and reg.resolve("a") is a and len(fetched) == 1
        await follower.before("a")  # known and fresh: no call
        assert len(fetched) == 1
        table.update(a=None, b="/p/b2")  # unloaded elsewhere; b re-loaded from another path
        follower.period_s = 0
        await follower.before("a")  # stale: refreshed in the background
        await follower._running
        with pytest.raises(OpenAIError):
            reg.resolve("a")
        assert reg.resolve("b").lora_path == "/p/b2"

    asyncio.run(main())


def test_a_coordinator_that_fails_leaves_the_replicas_view_and_answers_404_for_unknown_names():
    from cluster.http.lora import LoRAFollower

    async def main():
        reg = _registry()

        async def fetch():
            raise TimeoutError("coordinator restarting")

        await LoRAFollower(reg, fetch).before("x")
        with pytest.raises(OpenAIError) as e:
            reg.resolve("x")
        assert e.value.status == 404

    asyncio.run(main())
