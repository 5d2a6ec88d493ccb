"""Specification of the continuous-batching scheduler (CPU only, no model).

Every test drives the real Scheduler and KVCacheManager through schedule() /
update_from_output() with a fake model runner (see sched_factories). Block size is 4
unless a test says otherwise, so "n tokens" need ceil(n / 4) blocks.
"""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.sched.output import ModelRunnerOutput
from tests.engine.sched_factories import (
    DEFAULT_SAMPLED_TOKEN_ID,
    EOS_TOKEN_ID,
    create_request,
    create_requests,
    create_scheduler,
    make_runner_output,
    run_until_done,
    step,
)

# ---- token budget and chunked prefill ------------------------------------------------------


def test_total_scheduled_tokens_never_exceed_max_num_batched_tokens():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    for request in create_requests(6, prompt_len=10, max_tokens=5):
        scheduler.add_request(request)

    steps = run_until_done(scheduler)

    totals = [out.total_num_scheduled_tokens for out, _ in steps]
    assert all(total <= 16 for total in totals)
    assert max(totals) == 16  # the budget was actually the binding constraint
    for out, _ in steps:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())


def test_long_prompt_is_chunked_by_token_budget_until_prefill_completes():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    request = create_request("long", prompt_len=25, max_tokens=3)
    scheduler.add_request(request)

    chunks, sampled = [], []
    for _ in range(4):
        out, outputs = step(scheduler)
        chunks.append(out.num_scheduled_tokens["long"])
        sampled.append([o.new_token_ids for o in outputs])

    assert chunks == [10, 10, 5, 1]  # three prefill chunks, then one decode token
    assert sampled == [[], [], [[DEFAULT_SAMPLED_TOKEN_ID]], [[DEFAULT_SAMPLED_TOKEN_ID]]]


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = create_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    scheduler.add_request(create_request("long", prompt_len=25, max_tokens=3))

    chunks = [step(scheduler)[0].num_scheduled_tokens["long"] for _ in range(5)]

    assert chunks == [8, 8, 8, 1, 1]  # 8+8+8+1 = 25 prompt tokens, then a decode


def test_token_budget_still_limits_chunks_below_long_prefill_threshold():
    scheduler = create_scheduler(max_num_batched_tokens=6, long_prefill_token_threshold=8)
    scheduler.add_request(create_request("long", prompt_len=25, max_tokens=3))

    chunks = [step(scheduler)[0].num_scheduled_tokens["long"] for _ in range(5)]

    assert chunks == [6, 6, 6, 6, 1]


def test_long_prefill_token_threshold_lets_several_prefills_share_a_step():
    scheduler = create_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    a, b = create_requests(2, prompt_len=12, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)

    per_step = [step(scheduler)[0].num_scheduled_tokens for _ in range(3)]

    assert per_step == [
        {a.request_id: 5, b.request_id: 5},
        {a.request_id: 5, b.request_id: 5},
        {a.request_id: 2, b.request_id: 2},
    ]


def test_schedule_advances_num_computed_tokens_before_the_step_runs():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    request = create_request("r", prompt_len=25)
    scheduler.add_request(request)

    out = scheduler.schedule()

    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert request.num_computed_tokens == 10  # optimistic: already counts this step's chunk


def test_running_request_is_scheduled_before_waiting_request():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    first = create_request("first", prompt_len=20)
    scheduler.add_request(first)
    step(scheduler)  # first: 8 of 20 prompt tokens
    second = create_request("second", prompt_len=4)
    scheduler.add_request(second)

    out, _ = step(scheduler)

    assert out.num_scheduled_tokens == {"first": 8}  # the running prefill takes the whole budget
    assert list(scheduler.waiting) == [second]


def test_decode_gets_its_token_before_a_new_prefill_consumes_the_budget():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    decoding = create_request("decoding", prompt_len=8)
    scheduler.add_request(decoding)
    step(scheduler)  # full prefill, one token sampled
    scheduler.add_request(create_request("newcomer", prompt_len=20))

    out, _ = step(scheduler)

    assert list(out.num_scheduled_tokens.items()) == [("decoding", 1), ("newcomer", 7)]


def test_one_step_mixes_a_decode_and_a_prefill():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("decoding", prompt_len=6))
    step(scheduler)
    scheduler.add_request(create_request("prefilling", prompt_len=9))

    out, _ = step(scheduler)

    assert [r.req_id for r in out.scheduled_new_reqs] == ["prefilling"]
    assert out.scheduled_cached_reqs.req_ids == ["decoding"]
    assert out.num_scheduled_tokens == {"decoding": 1, "prefilling": 9}
    assert out.total_num_scheduled_tokens == 10


# ---- admission: max_num_seqs and KV capacity ------------------------------------------------


def test_max_num_seqs_caps_running_requests():
    scheduler = create_scheduler(max_num_seqs=2)
    requests = create_requests(4, prompt_len=4, max_tokens=10)
    for request in requests:
        scheduler.add_request(request)

    out, _ = step(scheduler)

    assert set(out.num_scheduled_tokens) == {requests[0].request_id, requests[1].request_id}
    assert scheduler.running == requests[:2]
    assert list(scheduler.waiting) == requests[2:]


def test_finished_request_frees_a_seat_for_the_next_waiting_request():
    scheduler = create_scheduler(max_num_seqs=1)
    short = create_request("short", prompt_len=4, max_tokens=1)
    queued = create_request("queued", prompt_len=4)
    scheduler.add_request(short)
    scheduler.add_request(queued)

    first, _ = step(scheduler)  # short prefills, samples its only token, finishes
    second, _ = step(scheduler)

    assert list(first.num_scheduled_tokens) == ["short"]
    assert [r.req_id for r in second.scheduled_new_reqs] == ["queued"]


def test_waiting_requests_are_not_admitted_when_blocks_run_out():
    scheduler = create_scheduler(num_blocks=4)
    running = create_request("running", prompt_len=10, max_tokens=10)  # 3 blocks
    scheduler.add_request(running)
    step(scheduler)  # its next decode (position 10) still fits in its third block
    big = create_request("big", prompt_len=8)  # needs 2 blocks, 1 is free
    small = create_request("small", prompt_len=4)  # would fit, but queues behind big
    scheduler.add_request(big)
    scheduler.add_request(small)

    out, _ = step(scheduler)

    assert out.num_scheduled_tokens == {"running": 1}
    assert out.preempted_req_ids == set()  # a newcomer never preempts running work
    assert list(scheduler.waiting) == [big, small]
    assert running.status == RequestStatus.RUNNING


# ---- new vs cached request data ----------------------------------------------------------------


def test_first_schedule_sends_new_request_data_with_all_block_ids():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=10)
    scheduler.add_request(request)

    out = scheduler.schedule()

    assert out.scheduled_cached_reqs.req_ids == []
    [new] = out.scheduled_new_reqs
    assert new.req_id == "r"
    assert new.prompt_token_ids == request.prompt_token_ids
    assert new.token_ids == request.prompt_token_ids
    assert new.num_computed_tokens == 0
    assert len(new.block_ids) == 3  # 10 tokens / block_size 4
    assert new.block_ids == scheduler.kv_cache_manager.get_block_ids("r")


def test_later_steps_send_cached_request_data_with_only_new_block_ids():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("r", prompt_len=10))
    first, _ = step(scheduler)
    prefill_blocks = first.scheduled_new_reqs[0].block_ids

    # Decode steps compute positions 10, 11 (still in block 3), then 12 (needs block 4).
    decodes = [step(scheduler)[0] for _ in range(3)]

    for out in decodes:
        assert out.scheduled_new_reqs == []
        assert out.scheduled_cached_reqs.req_ids == ["r"]
    assert [out.scheduled_cached_reqs.num_computed_tokens for out in decodes] == [[10], [11], [12]]
    assert decodes[0].scheduled_cached_reqs.new_block_ids == [[]]
    assert decodes[1].scheduled_cached_reqs.new_block_ids == [[]]
    [[new_block]] = decodes[2].scheduled_cached_reqs.new_block_ids
    assert new_block not in prefill_blocks
    assert scheduler.kv_cache_manager.get_block_ids("r") == [*prefill_blocks, new_block]


def test_next_prefill_chunk_sends_only_the_blocks_it_adds():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(create_request("r", prompt_len=25))
    first, _ = step(scheduler)  # tokens 0..9 -> 3 blocks

    second, _ = step(scheduler)  # tokens 10..19 -> 5 blocks in all

    assert second.scheduled_new_reqs == []
    assert second.scheduled_cached_reqs.req_ids == ["r"]
    [added] = second.scheduled_cached_reqs.new_block_ids
    assert len(added) == 2
    all_blocks = scheduler.kv_cache_manager.get_block_ids("r")
    assert all_blocks == first.scheduled_new_reqs[0].block_ids + added


# ---- preemption --------------------------------------------------------------------------------


def _fill_all_blocks_fcfs():
    """first, second (1 block each) and last (3 blocks) fill all 5 blocks and have each
    sampled one token; `waiting` (1 block) queues behind them. On the next step `first` needs
    a fifth-token block, so something must be preempted."""
    scheduler = create_scheduler(num_blocks=5, max_num_batched_tokens=64)
    first = create_request("first", prompt_len=4, max_tokens=2)
    second = create_request("second", prompt_len=4, max_tokens=2)
    last = create_request("last", prompt_len=12, max_tokens=4)
    for request in (first, second, last):
        scheduler.add_request(request)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    waiting = create_request("waiting", prompt_len=4, max_tokens=2)
    scheduler.add_request(waiting)
    return scheduler, first, second, last, waiting


def test_fcfs_preempts_the_most_recently_added_running_request():
    scheduler, first, second, last, _ = _fill_all_blocks_fcfs()

    out, _ = step(scheduler)

    assert out.preempted_req_ids == {"last"}
    assert out.num_scheduled_tokens == {"first": 1, "second": 1}


def test_preempted_request_is_reset_to_preempted_with_no_computed_tokens():
    scheduler, _, _, last, _ = _fill_all_blocks_fcfs()

    step(scheduler)

    assert last.status == RequestStatus.PREEMPTED
    assert last.num_computed_tokens == 0
    assert last.num_preemptions == 1
    assert last not in scheduler.running
    assert scheduler.kv_cache_manager.get_block_ids("last") == []


def test_preempted_request_goes_back_to_the_front_of_waiting():
    scheduler, _, _, last, waiting = _fill_all_blocks_fcfs()

    step(scheduler)

    assert list(scheduler.waiting) == [last, waiting]


def test_preempted_request_is_not_readmitted_in_the_step_that_preempted_it():
    # A chunk of 4 tokens (1 block) of the victim would fit after the preemption.
    scheduler = create_scheduler(num_blocks=3, long_prefill_token_threshold=4)
    a, b = create_requests(2, prompt_len=4, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # 1 block each, 1 free

    out, _ = step(scheduler)  # a takes the free block; b finds none and preempts itself

    assert out.preempted_req_ids == {b.request_id}
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 1
    assert out.scheduled_new_reqs == []
    assert out.num_scheduled_tokens == {a.request_id: 1}
    assert list(scheduler.waiting) == [b]


def test_no_newcomer_is_admitted_in_a_step_that_preempted():
    scheduler = create_scheduler(num_blocks=3, policy="priority")
    important = create_request("important", prompt_len=4, priority=0, arrival_time=0.0)
    unimportant = create_request("unimportant", prompt_len=4, priority=5, arrival_time=1.0)
    scheduler.add_request(important)
    scheduler.add_request(unimportant)
    step(scheduler)  # 1 block each, 1 free
    # Ranks ahead of the victim in the waiting queue, and needs only 1 block.
    newcomer = create_request("newcomer", prompt_len=4, priority=1, arrival_time=2.0)
    scheduler.add_request(newcomer)

    out, _ = step(scheduler)  # important takes the free block; unimportant is preempted

    assert out.preempted_req_ids == {"unimportant"}
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 1  # newcomer would fit
    assert out.scheduled_new_reqs == []
    assert out.num_scheduled_tokens == {"important": 1}
    assert newcomer.status == RequestStatus.WAITING
    assert scheduler.waiting.peek() is newcomer


def test_preempted_request_resumes_as_new_request_with_prompt_and_outputs():
    scheduler, _, _, last, _ = _fill_all_blocks_fcfs()
    step(scheduler)  # preempts `last`; first and second finish (max_tokens=2)

    out, _ = step(scheduler)

    assert out.scheduled_new_reqs[0].req_id == "last"
    resumed = out.scheduled_new_reqs[0]
    assert resumed.token_ids == [*last.prompt_token_ids, DEFAULT_SAMPLED_TOKEN_ID]
    assert resumed.prompt_token_ids == last.prompt_token_ids
    assert resumed.num_computed_tokens == 0
    assert len(resumed.block_ids) == 4  # 13 tokens
    assert out.num_scheduled_tokens["last"] == 13  # recomputes everything it had
    assert last.status == RequestStatus.RUNNING
    assert last.num_preemptions == 1


def test_request_preempts_itself_when_it_is_the_last_running_request():
    scheduler = create_scheduler(num_blocks=2)
    a, b = create_requests(2, prompt_len=4, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)  # 1 block each, no block left; both need a second one next step

    out, _ = step(scheduler)

    # a needs a block: b (last) is preempted, and its block goes to a.
    assert out.preempted_req_ids == {b.request_id}
    assert out.num_scheduled_tokens == {a.request_id: 1}
    assert scheduler.running == [a]


def _fill_all_blocks_with_priorities(policy: str):
    """low (priority 5) runs first and holds 5 blocks; then high (priority 0) and mid
    (priority 1) are admitted, filling all 9 blocks. On the next step `high` needs a block.
    Budget 16 per step."""
    scheduler = create_scheduler(num_blocks=9, max_num_batched_tokens=16, policy=policy)
    low = create_request("low", prompt_len=16, max_tokens=10, priority=5, arrival_time=0.0)
    scheduler.add_request(low)
    step(scheduler)  # low: 16 prompt tokens (4 blocks) + 1 sampled
    high = create_request("high", prompt_len=4, max_tokens=10, priority=0, arrival_time=1.0)
    mid = create_request("mid", prompt_len=40, max_tokens=10, priority=1, arrival_time=2.0)
    scheduler.add_request(high)
    scheduler.add_request(mid)
    out, _ = step(scheduler)  # low decodes (5th block), high prefills 4, mid prefills 11
    assert out.num_scheduled_tokens == {"low": 1, "high": 4, "mid": 11}
    assert scheduler.running == [low, high, mid]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 0
    return scheduler, low, high, mid


def test_priority_policy_preempts_the_largest_priority_value_even_if_not_last():
    scheduler, low, high, mid = _fill_all_blocks_with_priorities("priority")

    out, _ = step(scheduler)

    assert out.preempted_req_ids == {"low"}  # first in running, but the least important
    assert scheduler.running == [high, mid]
    assert low.status == RequestStatus.PREEMPTED


def test_priority_preemption_undoes_the_victims_schedule_and_returns_its_budget():
    scheduler, low, _, _ = _fill_all_blocks_with_priorities("priority")

    out, _ = step(scheduler)

    # low was scheduled (1 token) before high found no block; that schedule is withdrawn
    # and its token goes to mid: 1 + 15 fills the 16-token budget.
    assert out.num_scheduled_tokens == {"high": 1, "mid": 15}
    assert out.total_num_scheduled_tokens == 16
    assert "low" not in out.scheduled_cached_reqs.req_ids
    assert low.num_computed_tokens == 0


def test_fcfs_policy_ignores_priority_when_choosing_a_victim():
    scheduler, low, high, mid = _fill_all_blocks_with_priorities("fcfs")

    out, _ = step(scheduler)

    assert out.preempted_req_ids == {"mid"}
    assert out.num_scheduled_tokens == {"low": 1, "high": 1}
    assert scheduler.running == [low, high]


# ---- stop conditions ---------------------------------------------------------------------------


def test_eos_token_finishes_request_with_stop():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4, max_tokens=10, eos_token_id=EOS_TOKEN_ID)
    scheduler.add_request(request)

    _, outputs = step(scheduler, tokens=EOS_TOKEN_ID)

    [output] = outputs
    assert output.finish_reason == "stop"
    assert output.stop_reason is None
    assert output.new_token_ids == [EOS_TOKEN_ID]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_generating_past_eos_until_max_tokens():
    scheduler = create_scheduler()
    request = create_request(
        "r", prompt_len=4, max_tokens=4, eos_token_id=EOS_TOKEN_ID, ignore_eos=True
    )
    scheduler.add_request(request)

    steps = run_until_done(scheduler, tokens=EOS_TOKEN_ID)

    assert len(steps) == 4
    assert request.output_token_ids == [EOS_TOKEN_ID] * 4
    assert steps[-1][1][0].finish_reason == "length"


def test_stop_token_id_finishes_request_with_stop_and_stop_reason():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4, max_tokens=10, stop_token_ids=[42])
    scheduler.add_request(request)

    def second_token_is_42(req):
        return 42 if req.num_output_tokens == 1 else DEFAULT_SAMPLED_TOKEN_ID

    steps = run_until_done(scheduler, tokens=second_token_is_42)

    [output] = steps[-1][1]
    assert output.finish_reason == "stop"
    assert output.stop_reason == 42
    assert request.stop_reason == 42
    assert request.output_token_ids == [DEFAULT_SAMPLED_TOKEN_ID, 42]


def test_min_tokens_suppresses_eos_before_min_tokens():
    scheduler = create_scheduler()
    request = create_request(
        "r", prompt_len=4, max_tokens=10, min_tokens=3, eos_token_id=EOS_TOKEN_ID
    )
    scheduler.add_request(request)

    steps = run_until_done(scheduler, tokens=EOS_TOKEN_ID)

    assert [o.finish_reason for _, outputs in steps for o in outputs] == [None, None, "stop"]
    assert request.output_token_ids == [EOS_TOKEN_ID] * 3


def test_min_tokens_suppresses_stop_token_ids_before_min_tokens():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    scheduler.add_request(request)

    steps = run_until_done(scheduler, tokens=42)

    assert [o.finish_reason for _, outputs in steps for o in outputs] == [None, None, "stop"]
    assert request.output_token_ids == [42, 42, 42]
    assert request.stop_reason == 42


def test_max_tokens_finishes_request_with_length():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4, max_tokens=3)
    scheduler.add_request(request)

    steps = run_until_done(scheduler)

    assert [o.finish_reason for _, outputs in steps for o in outputs] == [None, None, "length"]
    assert request.num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.stop_reason is None


def test_max_model_len_finishes_request_with_length():
    scheduler = create_scheduler(max_model_len=10)
    request = create_request("r", prompt_len=8, max_tokens=100)
    scheduler.add_request(request)

    steps = run_until_done(scheduler)

    assert steps[-1][1][0].finish_reason == "length"
    assert request.num_tokens == 10
    assert request.num_output_tokens == 2


def test_abort_running_request_frees_its_blocks():
    scheduler = create_scheduler(num_blocks=10)
    request = create_request("r", prompt_len=10)
    scheduler.add_request(request)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 7

    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)

    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.status.finish_reason == "abort"
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 10
    assert scheduler.running == []
    assert "r" not in scheduler.requests


def test_abort_waiting_request_removes_it_before_it_is_scheduled():
    scheduler = create_scheduler(max_num_seqs=1)
    running = create_request("running", prompt_len=4)
    queued = create_request("queued", prompt_len=4)
    scheduler.add_request(running)
    scheduler.add_request(queued)
    step(scheduler)

    scheduler.finish_requests(["queued"], RequestStatus.FINISHED_ABORTED)
    steps = run_until_done(scheduler)

    assert queued.status == RequestStatus.FINISHED_ABORTED
    assert len(scheduler.waiting) == 0
    assert all("queued" not in out.num_scheduled_tokens for out, _ in steps)
    assert queued.num_output_tokens == 0


def test_abort_of_unknown_request_id_is_a_noop():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4)
    scheduler.add_request(request)
    step(scheduler)
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()

    scheduler.finish_requests(["no-such-request"], RequestStatus.FINISHED_ABORTED)

    assert scheduler.running == [request]
    assert request.status == RequestStatus.RUNNING
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before
    out, _ = step(scheduler)
    assert out.finished_req_ids == set()
    assert out.num_scheduled_tokens == {"r": 1}


def test_token_sampled_for_a_request_aborted_mid_step_is_dropped():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4)
    scheduler.add_request(request)
    out = scheduler.schedule()
    runner_output = make_runner_output(scheduler, out)

    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(out, runner_output)

    assert outputs == []
    assert request.output_token_ids == []


# ---- finishing: freed blocks and finished_req_ids ------------------------------------------------


def test_all_blocks_are_free_after_every_request_finishes():
    scheduler = create_scheduler(
        num_blocks=12, max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=True
    )
    shared_prefix = list(range(100, 108))
    requests = [
        create_request(f"shared-{i}", prompt_token_ids=[*shared_prefix, 200 + i], max_tokens=12)
        for i in range(3)
    ] + create_requests(3, prompt_len=10, max_tokens=12, id_prefix="own")
    for request in requests:
        scheduler.add_request(request)

    run_until_done(scheduler)

    assert any(r.num_preemptions > 0 for r in requests)  # the pool was really under pressure
    assert all(r.num_output_tokens == 12 for r in requests)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert kv.req_to_blocks == {}


def test_finished_request_id_is_reported_once_in_the_next_schedule_output():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("done", prompt_len=4, max_tokens=1))
    scheduler.add_request(create_request("busy", prompt_len=4, max_tokens=10))

    first, outputs = step(scheduler)
    second, _ = step(scheduler)
    third, _ = step(scheduler)

    assert {o.request_id for o in outputs if o.finished} == {"done"}
    assert first.finished_req_ids == set()
    assert second.finished_req_ids == {"done"}
    assert third.finished_req_ids == set()


def test_aborted_request_id_is_reported_in_the_next_schedule_output():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("r", prompt_len=4))
    step(scheduler)

    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()

    assert out.finished_req_ids == {"r"}
    assert out.num_scheduled_tokens == {}


# ---- intake ------------------------------------------------------------------------------------


def test_duplicate_request_id_raises_value_error():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("dup", prompt_len=4))

    with pytest.raises(ValueError, match="dup"):
        scheduler.add_request(create_request("dup", prompt_len=6))

    assert len(scheduler.waiting) == 1
    assert scheduler.requests["dup"].num_prompt_tokens == 4


# ---- prefix caching through the scheduler ----------------------------------------------------


def test_second_request_with_same_prompt_hits_the_prefix_cache():
    scheduler = create_scheduler(enable_prefix_caching=True)
    prompt = list(range(500, 516))  # 16 tokens = 4 full blocks
    scheduler.add_request(create_request("first", prompt_token_ids=prompt))
    first, _ = step(scheduler)
    second_request = create_request("second", prompt_token_ids=prompt)
    scheduler.add_request(second_request)

    out, outputs = step(scheduler)

    # 3 of 4 blocks hit: the last token is always recomputed to get logits.
    assert second_request.num_cached_tokens == 12
    assert out.num_scheduled_tokens["second"] == 4
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == 12
    assert new.block_ids[:3] == first.scheduled_new_reqs[0].block_ids[:3]
    assert {o.request_id: o.num_cached_tokens for o in outputs}["second"] == 12


def test_request_with_a_different_prompt_gets_no_prefix_cache_hit():
    scheduler = create_scheduler(enable_prefix_caching=True)
    scheduler.add_request(create_request("first", prompt_token_ids=list(range(500, 516))))
    step(scheduler)
    other = create_request("other", prompt_token_ids=list(range(600, 616)))
    scheduler.add_request(other)

    out, _ = step(scheduler)

    assert other.num_cached_tokens == 0
    assert out.num_scheduled_tokens["other"] == 16


def test_finished_request_blocks_stay_hittable_for_a_later_request():
    scheduler = create_scheduler(enable_prefix_caching=True)
    prompt = list(range(500, 509))  # 9 tokens: 2 full blocks
    scheduler.add_request(create_request("first", prompt_token_ids=prompt, max_tokens=1))
    step(scheduler)  # first finishes and frees its blocks
    assert scheduler.kv_cache_manager.get_num_free_blocks() == scheduler.kv_cache_manager.num_blocks
    later = create_request("later", prompt_token_ids=prompt)
    scheduler.add_request(later)

    out, _ = step(scheduler)

    assert later.num_cached_tokens == 8
    assert out.num_scheduled_tokens["later"] == 1


def test_runner_output_for_a_prefill_chunk_reports_nothing():
    scheduler = create_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(create_request("r", prompt_len=10))
    out = scheduler.schedule()

    outputs = scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[]])
    )

    assert outputs == []
    assert scheduler.requests["r"].num_output_tokens == 0


def test_prefix_cache_stats_count_each_request_once_even_when_admission_is_retried():
    # Room for one 8-token request at a time: the second waits (and is looked up again)
    # for several steps before it is admitted.
    scheduler = create_scheduler(enable_prefix_caching=True, num_blocks=3, block_size=4)
    scheduler.add_request(create_request("a", prompt_token_ids=list(range(100, 108)), max_tokens=3))
    scheduler.add_request(create_request("b", prompt_token_ids=list(range(200, 208)), max_tokens=3))
    run_until_done(scheduler)
    stats = scheduler.kv_cache_manager.stats
    assert (stats.requests, stats.queries) == (2, 16)
