"""The Coordinator's scale/status/autoscale logic against a fake Serve control (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.control.autoscale import AutoscaleConfig
from cluster.control.coordinator import Coordinator, ScaleRequestError, parse_scale_request
from cluster.http.control_answers import scale_response, status_response
from cluster.report import ReplicaReport
from cluster.roles import Role
from engine.load import EngineLoad


class FakeControl:
    """Records scale calls; `settle()` makes Serve report every deployment at its target."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.counts: dict[str, int] = {}
        self.target: dict[str, int] = {}

    async def set_replicas(self, deployment, n):
        self.calls.append((deployment, n))
        self.target[deployment] = n

    def settle(self):
        self.counts.update(self.target)

    async def replica_states(self):
        return {d: {"RUNNING": n} for d, n in self.counts.items()}

    async def settled(self, targets):
        return all(self.counts.get(d, t if d not in self.target else -1) == t for d, t in targets.items())


def _fig(replica, role, ttft_p90_s=None, itl_p90_s=None, **engine):
    """A replica's report; `engine`: its EngineLoad fields (10 free blocks of 10 unless given)."""
    load = EngineLoad(**{"free_blocks": 10, "total_blocks": 10, **engine})
    return ReplicaReport(replica, Role.of(role), load, ttft_p90_s=ttft_p90_s, itl_p90_s=itl_p90_s)


def run(coro):
    return asyncio.run(coro)


def _scale(coord: Coordinator, body) -> tuple[int, dict]:
    """`POST /scale` as the ingress answers it: (status code, JSON body)."""
    response = scale_response(run(coord.scale(body)))
    return response.status_code, json.loads(response.body)


def _status(coord: Coordinator) -> dict:
    """`GET /status`'s body."""
    return json.loads(status_response(run(coord.status())).body)


@pytest.mark.parametrize("body,param", [
    ({"prefill": -1}, "prefill"), ({"prefill": 0}, "prefill"), ({"decode": 2.5}, "decode"),
    ({"decode": "2"}, "decode"), ({"prefill": True}, "prefill"), ({"prefill": 9}, "prefill"),
    ({"gpu": 1}, "gpu"), ({}, None), ([1, 2], None), (None, None),
])
def test_bad_scale_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ScaleRequestError) as e:
        parse_scale_request(body, ("prefill", "decode"), {"prefill": 8, "decode": 8})
    assert e.value.status == 400 and e.value.param == param


def test_partial_scale_keeps_the_other_role():
    assert parse_scale_request({"decode": 3}, ("prefill", "decode"), {"prefill": 8, "decode": 8}) == {"decode": 3}


def test_scale_is_202_then_409_until_serve_settles():
    control = FakeControl()
    coord = Coordinator("pd", "app", {"prefill": 1, "decode": 1}, {"prefill": 4, "decode": 4}, control=control)
    code, body = _scale(coord, {"prefill": 2, "decode": 2})
    assert code == 202 and body == {"target": {"prefill": 2, "decode": 2}, "scaling": True}
    assert sorted(control.calls) == [("Decode", 2), ("Prefill", 2)]
    code, body = _scale(coord, {"prefill": 1})
    assert code == 409 and body["error"]["code"] == 409
    assert _status(coord)["scaling"] is True
    control.settle()
    status = _status(coord)
    assert status["scaling"] is False and status["target"] == {"prefill": 2, "decode": 2}
    code, _ = _scale(coord, {"prefill": 1})
    assert code == 202 and control.calls[-1] == ("Prefill", 1)
    code, body = _scale(coord, {"decode": 5})
    assert code == 400 and body["error"]["param"] == "decode"  # above the configured maximum


def test_direct_streaming_scales_the_ingress_deployment():
    control = FakeControl()
    coord = Coordinator("colocated", "app", {"colocated": 1}, {"colocated": 4}, control=control,
                        deployments={"colocated": "Ingress"})
    code, _ = _scale(coord, {"colocated": 3})
    assert code == 202 and control.calls == [("Ingress", 3)]
    control.settle()
    assert _status(coord)["scaling"] is False  # settled on the Ingress deployment's count


def test_status_groups_replicas_by_role_with_load_fields():
    coord = Coordinator("pd", "app", control=FakeControl())
    coord._store_stats = lambda: _const({"live_transfers": 3, "bytes": 99})
    run(coord.report(_fig("p-1", "prefill", waiting=2)))
    run(coord.report(_fig("d-1", "decode", running=5, free_blocks=4)))
    run(coord.report(_fig("d-2", "decode")))
    s = _status(coord)
    assert [r["replica"] for r in s["prefill"]] == ["p-1"] and s["prefill"][0]["waiting"] == 2
    assert [r["replica"] for r in s["decode"]] == ["d-1", "d-2"]
    assert {"replica", "running", "waiting", "free_blocks", "total_blocks"} <= set(s["decode"][0])
    assert s["store"] == {"live_transfers": 3, "bytes": 99}
    assert s["scaling"] is False and s["target"] == {"prefill": 1, "decode": 1}
    run(coord.forget("d-2"))
    assert [r["replica"] for r in _status(coord)["decode"]] == ["d-1"]


def test_status_names_the_cpu_kernels_each_replica_runs():
    coord = Coordinator("pd", "app", control=FakeControl())
    coord._store_stats = lambda: _const({})
    run(coord.report(_fig("p-1", "prefill", cpu_kernels="avx2")))
    run(coord.report(_fig("d-1", "decode")))  # a GPU engine reports none
    s = _status(coord)
    assert s["prefill"][0]["cpu_kernels"] == "avx2" and s["decode"][0]["cpu_kernels"] is None


async def _const(value):
    return value


def test_manual_scale_is_409_when_autoscaling_owns_the_counts():
    coord = Coordinator("pd", "app", autoscale={"enabled": True}, control=FakeControl())
    assert _scale(coord, {"prefill": 2})[0] == 409


def test_autoscale_tick_applies_the_policy_through_serve_and_waits_for_it():
    control = FakeControl()
    coord = Coordinator("pd", "app", autoscale={"enabled": True, "up_ticks": 1, "cooldown_ticks": 0},
                        control=control)
    assert isinstance(coord.autoscale, AutoscaleConfig)
    coord.board.report(_fig("p-1", "prefill", ttft_p90_s=5.0))  # far above the 1 s target
    coord.board.report(_fig("d-1", "decode", itl_p90_s=0.06))  # neither pressured nor idle
    assert run(coord.autoscale_tick()) == {"prefill": 2}
    assert control.calls == [("Prefill", 2)]
    assert run(coord.autoscale_tick()) == {}  # still converging: no new decision
    control.settle()
    assert run(coord.autoscale_tick()) == {"prefill": 3}


def test_a_change_serve_refuses_is_503_and_keeps_the_old_target():
    class Refusing(FakeControl):
        async def set_replicas(self, deployment, n):
            raise RuntimeError("external scaling is disabled for this application")

    coord = Coordinator("pd", "app", control=Refusing())
    code, body = _scale(coord, {"prefill": 2})
    assert code == 503 and "external scaling is disabled" in body["error"]["message"]
    assert coord.targets == {"prefill": 1, "decode": 1}


def test_a_target_serve_never_reaches_stops_blocking_after_the_timeout():
    control = FakeControl()
    coord = Coordinator("pd", "app", control=control, scale_timeout_s=0.0)
    assert _scale(coord, {"prefill": 3})[0] == 202
    # Never settles (e.g. no room for a third replica): reported as stuck, new targets accepted.
    s = _status(coord)
    assert s["scaling"] is False and "not reached" in s["stuck"]
    assert _scale(coord, {"prefill": 2})[0] == 202


def test_partial_autoscale_ceiling_keeps_the_manual_one_for_other_roles():
    coord = Coordinator("pd", "app", max_replicas={"prefill": 6, "decode": 6},
                        autoscale={"max_replicas": {"decode": 3}}, control=FakeControl())
    assert coord.autoscale.max_replicas["prefill"] == 6 and coord.autoscale.max_replicas["decode"] == 3


def test_a_restarted_coordinator_adopts_the_counts_serve_runs():
    control = FakeControl()
    control.counts = {"Prefill": 3, "Decode": 2}  # set by an earlier coordinator's /scale
    coord = Coordinator("pd", "app", {"prefill": 1, "decode": 1}, {"prefill": 4, "decode": 4}, control=control)
    assert _status(coord)["target"] == {"prefill": 3, "decode": 2}


class CountingControl(FakeControl):
    def __init__(self):
        super().__init__()
        self.reads = 0

    async def replica_states(self):
        self.reads += 1
        return await super().replica_states()


@pytest.mark.parametrize("first", ["engine replica", "ingress"])
def test_the_first_report_syncs_the_counts_before_any_status_asks(first):
    # Serve's status call is slow the first time in a process: the sync runs in the
    # background from the first report, and /status does not read Serve again.
    control = CountingControl()
    control.counts = {"Prefill": 2, "Decode": 3}
    coord = Coordinator("pd", "app", control=control)
    coord._store_stats = lambda: _const({"live_transfers": 0, "bytes": 0})

    async def go():
        if first == "ingress":
            await coord.report_ingress_metrics("ingress-1", None)
        else:
            await coord.report(_fig("p-1", "prefill"))
        assert control.reads == 0 and coord._sync_task is not None  # started, not awaited
        await coord._sync_task
        assert coord.targets == {"prefill": 2, "decode": 3}
        await coord.report(_fig("d-1", "decode"))
        return (await coord.status()).as_json()

    assert run(go())["target"] == {"prefill": 2, "decode": 3} and control.reads == 1


def test_a_background_sync_cut_short_is_done_by_the_next_status():
    class StuckOnce(CountingControl):
        async def replica_states(self):
            if self.reads == 0:
                self.reads += 1
                await asyncio.Event().wait()  # cancelled when its event loop ends
            return await super().replica_states()

    control = StuckOnce()
    control.counts = {"Prefill": 2, "Decode": 1}
    coord = Coordinator("pd", "app", control=control)
    coord._store_stats = lambda: _const({"live_transfers": 0, "bytes": 0})
    run(coord.report(_fig("p-1", "prefill")))  # the loop ends with the sync task waiting: cancelled
    assert control.reads == 1 and coord.targets == {"prefill": 1, "decode": 1}
    assert _status(coord)["target"] == {"prefill": 2, "decode": 1} and control.reads == 2


def test_a_target_beyond_free_resources_is_409_with_the_numbers_and_changes_nothing():
    control = FakeControl()
    coord = Coordinator("pd", "app", {"prefill": 1, "decode": 1}, {"prefill": 4, "decode": 4}, control=control,
                        replica_resources={"CPU": 2.0, "GPU": 1.0}, resources=lambda: {"CPU": 3.0, "GPU": 1.0})
    code, body = _scale(coord, {"prefill": 2, "decode": 2})  # 4 CPUs and 2 GPUs more
    assert code == 409 and control.calls == [] and coord.targets == {"prefill": 1, "decode": 1}
    err = body["error"]
    assert err["needed"] == {"CPU": 4.0, "GPU": 2.0} and err["free"] == {"CPU": 3.0, "GPU": 1.0}
    assert "CPU 4" in err["message"] and "free CPU 3" in err["message"]
    code, _ = _scale(coord, {"decode": 2})  # one more replica fits
    assert code == 202 and control.calls == [("Decode", 2)]
    control.settle()
    assert _scale(coord, {"decode": 1})[0] == 202  # scaling down never needs resources


def test_with_a_cluster_autoscaler_the_target_is_accepted_and_status_says_what_it_waits_for():
    control = FakeControl()
    coord = Coordinator("colocated", "app", {"colocated": 1}, {"colocated": 4}, control=control,
                        replica_resources={"CPU": 1.0, "GPU": 0.0}, cluster_autoscaling=True,
                        resources=lambda: {"CPU": 0.5, "GPU": 0.0})
    control.counts = {"Colocated": 1}
    assert _scale(coord, {"colocated": 3})[0] == 202
    pending = _status(coord)["pending"]
    assert pending["replicas"] == {"colocated": 2} and pending["short"] == {"CPU": 1.5}
    assert "autoscaler" in pending["reason"] and "needs CPU 2" in pending["reason"]
    control.settle()
    status = _status(coord)
    assert status["scaling"] is False and status["pending"] is None
