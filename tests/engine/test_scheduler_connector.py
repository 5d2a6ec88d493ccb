"""The scheduler's KV-connector hooks and the WAITING_FOR_REMOTE_KVS state (P/D consumer)."""

from __future__ import annotations

from engine.kv_connector import KVConnectorBase, KVConnectorRole
from engine.kv_transfer_params import KVTransferParams
from engine.request import RequestStatus
from engine.sched.output import KVConnectorOutput
from tests.engine.sched_factories import create_request, create_scheduler, make_runner_output


class FakeConnector(KVConnectorBase):
    """Scheduler side only: claims `remote` tokens of every prompt are loadable
    asynchronously."""

    def __init__(self, remote: int, delay_free: bool = False) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.remote = remote
        self.delay_free = delay_free
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []
        self.reported: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = min(self.remote, request.num_tokens - 1) - num_computed_tokens
        return max(n, 0), n > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return {"allocated": dict(self.allocated)}

    def update_connector_output(self, output):
        self.reported.append(output)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay_free, KVTransferParams(transfer_id=request.request_id)

    # The worker side is not exercised here.
    def register_kv_caches(self, kv_caches, layer_groups=None): ...
    def set_wakeup(self, callback): ...
    def start_load_kv(self, metadata): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata): ...
    def wait_for_save(self, metadata): ...
    def get_finished(self): return KVConnectorOutput()


def _scheduler(connector, **kw):
    return create_scheduler(block_size=4, connector=connector, **kw)


def test_remote_kv_request_waits_with_blocks_allocated_and_nothing_scheduled():
    conn = FakeConnector(remote=8)
    scheduler = _scheduler(conn)
    req = create_request("r", prompt_token_ids=list(range(10, 19)))  # 9 tokens
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    [main_ids] = conn.allocated["r"][0]  # one KV cache group: a plain model
    assert conn.allocated["r"][1] == 8 and len(main_ids) == 2
    assert out.kv_connector_metadata == {"allocated": conn.allocated}
    assert scheduler.schedule().num_scheduled_tokens == {}  # still waiting


def test_remote_kv_request_decodes_without_recomputing_its_prompt_once_loaded():
    scheduler = _scheduler(FakeConnector(remote=8))
    req = create_request("r", prompt_token_ids=list(range(10, 19)))
    scheduler.add_request(req)
    scheduler.schedule()
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_runner_output(scheduler, out, kv_connector_output=KVConnectorOutput(finished_recving={"r"})))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 1}  # only the last prompt token
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert req.status == RequestStatus.RUNNING and req.num_cached_tokens == 8


def test_other_requests_run_while_one_waits_for_remote_kv():
    conn = FakeConnector(remote=8)
    scheduler = _scheduler(conn)
    scheduler.add_request(create_request("remote", prompt_token_ids=list(range(10, 19))))
    scheduler.schedule()
    conn.remote = 0
    scheduler.add_request(create_request("local", prompt_token_ids=[1, 2, 3]))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"local": 3}


def test_finished_request_reports_kv_transfer_params_and_frees_blocks():
    scheduler = _scheduler(FakeConnector(remote=0))
    scheduler.add_request(create_request("r", prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=1))
    out = scheduler.schedule()
    [co] = scheduler.update_from_output(out, make_runner_output(scheduler, out))
    assert co.finished and co.kv_transfer_params == KVTransferParams(transfer_id="r")
    assert scheduler.connector.finished == ["r"]
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_delay_free_leaves_blocks_to_the_connector():
    scheduler = _scheduler(FakeConnector(remote=0, delay_free=True))
    scheduler.add_request(create_request("r", prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_runner_output(scheduler, out))
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks - 2
    assert scheduler.has_work()  # steps go on until the worker side reports
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_runner_output(scheduler, out, kv_connector_output=KVConnectorOutput(finished_sending={"r"})))
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert not scheduler.has_work()


def test_abort_while_waiting_for_remote_kv_frees_its_blocks():
    scheduler = _scheduler(FakeConnector(remote=8))
    scheduler.add_request(create_request("r", prompt_token_ids=list(range(10, 19))))
    scheduler.schedule()
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert not scheduler.has_unfinished_requests()


def test_failed_load_with_fail_policy_finishes_the_request_with_an_error():
    conn = FakeConnector(remote=8)
    scheduler = _scheduler(conn)
    scheduler.add_request(create_request("r", prompt_token_ids=list(range(10, 19))))
    out = scheduler.schedule()
    report = KVConnectorOutput(failed_recving={"r": "KV load failed: gone"})
    [co] = scheduler.update_from_output(out, make_runner_output(scheduler, out, kv_connector_output=report))
    assert co.finish_reason == "error" and co.stop_reason == "KV load failed: gone"
    assert conn.reported == [report]
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks and not scheduler.has_unfinished_requests()


def test_failed_load_with_recompute_policy_computes_the_prompt_locally():
    conn = FakeConnector(remote=8)
    conn.kv_load_failure_policy = "recompute"
    scheduler = _scheduler(conn)
    scheduler.add_request(create_request("r", prompt_token_ids=list(range(10, 19))))
    out = scheduler.schedule()
    conn.remote = 0  # as a connector that remembers the failed load
    assert scheduler.update_from_output(
        out, make_runner_output(scheduler, out, kv_connector_output=KVConnectorOutput(failed_recving={"r": "gone"}))) == []
    assert scheduler.schedule().num_scheduled_tokens == {"r": 9}
