"""Assembly of one step's SchedulerOutput from what the scheduler decided: new requests in
full, running ones as deltas (new blocks, progress), plus the grammar bitmask and the KV
connector's metadata for the step."""

from __future__ import annotations

from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput


def build_scheduler_output(sched, new_reqs, running_reqs, num_scheduled, new_blocks, preempted) -> SchedulerOutput:
    """`sched` is the engine.sched.scheduler.Scheduler that scheduled the step."""
    new_data = [
        NewRequestData(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.all_token_ids),
            sampling_params=r.sampling_params,
            block_ids=sched.kv_cache_manager.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens,
            kv_transfer_params=r.kv_transfer_params,
            mm_features=None if r.mm_features is None else r.mm_features.without_pixels(),
        )
        for r in new_reqs
    ]
    cached = CachedRequestData()
    for r in running_reqs:
        cached.req_ids.append(r.request_id)
        cached.new_block_ids.append(new_blocks[r.request_id].get_block_ids())
        cached.num_computed_tokens.append(r.num_computed_tokens)
    out = SchedulerOutput(
        scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(sched.finished_req_ids),
        preempted_req_ids={r.request_id for r in preempted},
    )
    if sched.structured_output_manager is not None:
        out.structured_output_request_ids, out.grammar_bitmask = (
            sched.structured_output_manager.grammar_bitmask(new_reqs + running_reqs, num_scheduled))
    if sched.remote_kv is not None:
        out.kv_connector_metadata = sched.remote_kv.connector.build_connector_meta(out)
    return out
