"""Assembly of one step's SchedulerOutput from what the scheduler decided: new requests in
full, running ones as deltas (new blocks, progress), plus the grammar bitmask and the KV
connector's metadata for the step."""

from __future__ import annotations

from engine.kv_cache import KVCacheBlocks, KVCacheManager
from engine.kv_connector import KVConnectorBase
from engine.request import Request
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.structured_output import StructuredOutputManager


def build_scheduler_output(new_reqs: list[Request], running_reqs: list[Request], num_scheduled: dict[str, int],
                           new_blocks: dict[str, KVCacheBlocks], preempted: list[Request], *,
                           kv_cache_manager: KVCacheManager, finished_req_ids: set[str],
                           structured_output_manager: StructuredOutputManager | None,
                           connector: KVConnectorBase | None) -> SchedulerOutput:
    """The step's output: `new_reqs` in full (their blocks from `kv_cache_manager`),
    `running_reqs` as their `new_blocks` and progress, the requests finished since the last
    step, and what the grammar manager and the KV connector add."""
    new_data = [
        NewRequestData(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.all_token_ids),
            sampling_params=r.sampling_params,
            block_ids=kv_cache_manager.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens,
            kv_transfer_params=r.kv_transfer_params,
            mm_features=None if r.mm_features is None else r.mm_features.without_pixels(),
            window_block_ids=kv_cache_manager.get_window_block_ids(r.request_id),
            lora_request=r.lora_request,
            pooling_params=r.pooling_params,
        )
        for r in new_reqs
    ]
    cached = CachedRequestData()
    for r in running_reqs:
        cached.req_ids.append(r.request_id)
        cached.new_block_ids.append(new_blocks[r.request_id].get_block_ids())
        if kv_cache_manager.window_group is not None:
            cached.new_window_block_ids.append(new_blocks[r.request_id].get_window_block_ids())
        cached.num_computed_tokens.append(r.num_computed_tokens)
    out = SchedulerOutput(
        scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(finished_req_ids),
        preempted_req_ids={r.request_id for r in preempted},
    )
    if structured_output_manager is not None:
        out.structured_output_request_ids, out.grammar_bitmask = (
            structured_output_manager.grammar_bitmask(new_reqs + running_reqs, num_scheduled))
    if connector is not None:
        out.kv_connector_metadata = connector.build_connector_meta(out)
    return out
