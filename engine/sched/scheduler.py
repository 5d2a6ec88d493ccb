"""Continuous-batching scheduler (vLLM V1's unified token budget): RUNNING first, then WAITING, then the output.

Prefill and decode are not distinguished: every request advances `num_computed_tokens`
towards `num_tokens` under one per-step token budget, which gives chunked prefill and mixed
prefill/decode batches for free.
"""

from __future__ import annotations

import logging
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import KVCacheBlocks, KVCacheManager
from engine.kv_connector import KVConnectorBase
from engine.kv_transfer_params import KVTransferParams
from engine.lora.sched import lora_slots_full
from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.multimodal.sched_encoder import (
    commit_encoder_inputs,
    plan_encoder_inputs,
    release_all,
    release_computed,
)
from engine.request import Request, RequestStatus
from engine.sched.build import build_scheduler_output
from engine.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from engine.sched.remote_kv import RemoteKVTracker
from engine.sched.request_queue import make_queue
from engine.spec_decode.metrics import SpecDecodingStats
from engine.spec_decode.scheduling import drafts_to_verify, lookahead_slots

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the queues and decides each step; the KV connector's bookkeeping lives in
    engine.sched.remote_kv, the per-token stop check in Request.check_stop."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int, connector: KVConnectorBase | None = None,
                 structured_output_manager=None, encoder_cache: EncoderCacheManager | None = None,
                 encoder_budget: int = 0, num_speculative_tokens: int = 0,
                 num_lookahead_tokens: int = 0, max_loras: int = 0) -> None:
        if scheduler_config.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens must be resolved (resolved_token_budget) first")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        # The optional KV connector's scheduler side (engine.kv_connector) and its bookkeeping.
        self.remote_kv = None if connector is None else RemoteKVTracker(connector, kv_cache_manager, self.requests)
        self.waiting = make_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # cumulative, for metrics
        self.structured_output_manager = structured_output_manager  # fills the grammar bitmask
        self._pending_outputs: list[EngineCoreOutput] = []  # grammar compile failures, to report
        # Images (engine.multimodal): the encoder cache's bookkeeping and the per-step budget
        # in encoder embeddings; None for a text-only model.
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget
        self.encoder_seconds = 0.0  # cumulative, reported by the runner, for metrics
        # Speculative decoding: drafts a running request may verify per step (0: off).
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_stats = SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens else None
        # Slots reserved past a request's scheduled tokens, where a draft model writes the KV of
        # the drafts it decodes after the step (0 for the n-gram proposer, which has no KV).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_loras = max_loras  # adapters per step (engine.lora.sched); 0: LoRA off

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string). Unknown ids are ignored."""
        assert status.finished
        for req_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    @property
    def connector(self) -> KVConnectorBase | None:
        return None if self.remote_kv is None else self.remote_kv.connector

    def _uses_encoder(self, request: Request) -> bool:
        return self.encoder_cache is not None and request.mm_features is not None

    def _free_request(self, request: Request) -> KVTransferParams | None:
        if self._uses_encoder(request):
            release_all(self.encoder_cache, request)
        kv_params = None
        if self.remote_kv is not None:
            kv_params = self.remote_kv.release(request)  # may hold the blocks for an export
        else:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return kv_params

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, KVCacheBlocks] = {}
        spec_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        encoder_budget = self.encoder_budget
        to_encode: dict = {}  # mm_hash -> pixel values, for the runner
        unencodable: list[tuple[Request, bool]] = []  # (request, already out of its queue)

        # Phase 1: RUNNING requests, in order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = request.num_tokens - request.num_computed_tokens
            if threshold:
                n = min(n, threshold)
            n = min(n, budget, self.max_model_len - request.num_computed_tokens)
            plan = None
            if n > 0 and self._uses_encoder(request):
                release_computed(self.encoder_cache, request)
                plan = plan_encoder_inputs(self.encoder_cache, request, request.num_computed_tokens, n,
                                           encoder_budget)
                n = plan.num_new_tokens
                if n <= 0 and plan.missing_pixels:
                    unencodable.append((request, False))
            if n <= 0:
                i += 1
                continue
            drafts = drafts_to_verify(request, n, budget, self.max_model_len)
            n += len(drafts)
            blocks = None
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, n + self._lookahead(request, n, request.num_computed_tokens))
                if blocks is not None:
                    break
                victim = self._pick_victim()
                victim_idx = self.running.index(victim)
                self.running.pop(victim_idx)
                if victim in scheduled_running:
                    # Undo the victim's schedule this step: it gives its tokens back.
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                if victim_idx < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                continue  # `request` itself was preempted; running[i] is now the next one
            if plan is not None:
                commit_encoder_inputs(self.encoder_cache, request, plan, to_encode)
                encoder_budget -= plan.cost
            scheduled_running.append(request)
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = blocks
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= n
            i += 1

        # Phase 2: WAITING requests, unless this step had to preempt (no room to admit).
        skipped: list[Request] = []
        while not preempted and len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request, skipped):
                continue
            if lora_slots_full(request, self.running, self.max_loras):
                skipped.append(self.waiting.pop())
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self.remote_kv.load_finished(request):
                    skipped.append(self.waiting.pop())
                    continue
            load_async = False
            num_external = 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
                if self.remote_kv is not None:
                    num_external, load_async = self.remote_kv.num_external_tokens(request, num_local)
            else:
                hit_blocks, num_local = KVCacheBlocks(), 0
            num_computed = request.num_computed_tokens + num_local + num_external
            if load_async:
                n = 0
            else:
                n = request.num_tokens - num_computed
                if threshold:
                    n = min(n, threshold)
                n = min(n, budget)
            plan = None
            if not load_async and self._uses_encoder(request):
                plan = plan_encoder_inputs(self.encoder_cache, request, num_computed, n, encoder_budget)
                if plan.num_new_tokens <= 0 and plan.missing_pixels:
                    unencodable.append((self.waiting.pop(), True))
                    continue
                if plan.num_new_tokens <= 0:
                    break  # its next image does not fit this step's encoder budget or cache
                n = plan.num_new_tokens
            blocks = self.kv_cache_manager.allocate_slots(
                request, n + (0 if load_async else self._lookahead(request, n, num_computed)),
                num_new_computed_tokens=num_local, new_computed_blocks=hit_blocks,
                num_external_computed_tokens=num_external, delay_cache_blocks=load_async)
            if blocks is None:
                break  # admission control: do not preempt running work for a newcomer
            if self.remote_kv is not None:
                self.remote_kv.allocated(request, num_external)
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_local + num_external
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_local)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if load_async:
                request.num_computed_tokens = num_computed
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(request)
                continue
            request.num_computed_tokens = num_computed
            if plan is not None:
                commit_encoder_inputs(self.encoder_cache, request, plan, to_encode)
                encoder_budget -= plan.cost
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = blocks
            budget -= n
        for request in reversed(skipped):
            self.waiting.prepend(request)
        for request, dequeued in unencodable:
            self._fail_unencodable(request, dequeued)

        out = build_scheduler_output(
            scheduled_new, scheduled_running, num_scheduled, new_blocks, preempted,
            kv_cache_manager=self.kv_cache_manager, finished_req_ids=self.finished_req_ids,
            structured_output_manager=self.structured_output_manager,
            connector=self.connector)
        if self.encoder_cache is not None:
            freed = self.encoder_cache.take_freed()
            for mm_hash in freed:
                if mm_hash not in self.encoder_cache.cached:
                    to_encode.pop(mm_hash, None)  # allocated, then evicted within this step
            out.scheduled_encoder_inputs, out.free_encoder_mm_hashes = to_encode, freed
        out.scheduled_spec_decode_tokens = spec_tokens
        # Optimistically advance progress: the next schedule() already sees this step's work.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        self.finished_req_ids = set()
        return out

    def _lookahead(self, request: Request, n: int, num_computed: int) -> int:
        return lookahead_slots(request, n, num_computed, self.num_lookahead_tokens, self.max_model_len)

    def _grammar_ready(self, request: Request, skipped: list[Request]) -> bool:
        """Pops the request unless its grammar compiled (then it is WAITING); else an error."""
        if not request.structured_output_request.ready:
            skipped.append(self.waiting.pop())
            return False
        error = request.structured_output_request.compile_error
        if error is not None:
            self.waiting.pop()
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request)
            self._pending_outputs.append(EngineCoreOutput(request.request_id, [], "error", error))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _fail_unencodable(self, request: Request, dequeued: bool) -> None:
        """A P/D decode request that must compute image placeholders (its KV load failed and
        the policy recomputes): it has no pixels, so it fails instead of waiting forever."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not dequeued:
            self.waiting.remove(request)  # preempted later in the same step
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        self._pending_outputs.append(EngineCoreOutput(
            request.request_id, [], "error", "the prompt's image KV must be recomputed but this side "
            "has no pixels (P/D decode)"))

    def _pick_victim(self) -> Request:
        return max(self.running, key=Request.sort_key) if self.config.scheduling_policy == "priority" \
            else self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free all blocks, rewind, and requeue at the front."""
        self.kv_cache_manager.free(request)
        if self._uses_encoder(request):
            release_all(self.encoder_cache, request)  # cached outputs stay until evicted
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if not request.output_token_ids:
            request.prompt_logprob_entries = []  # the prompt is scored again from its start
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        logger.debug("preempted %s (%d preemptions)", request.request_id, request.num_preemptions)

    # ---- update -------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        self.encoder_seconds += runner_output.encoder_seconds
        if runner_output.kv_connector_output is not None:
            outputs += self.remote_kv.apply(runner_output.kv_connector_output,
                                            lambda rid: self.finish_requests(rid, RequestStatus.FINISHED_ERROR))
        scored = runner_output.prompt_logprobs  # prompt positions scored this step, by request
        pooled = runner_output.pooler_output  # pooling requests whose prompt is done (engine.pooling)
        for idx, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            new_ids = runner_output.sampled_token_ids[idx]
            if runner_output.spec_token_ids is not None:
                request.spec_token_ids = runner_output.spec_token_ids[idx]
            if scored and req_id in scored:
                request.prompt_logprob_entries += scored[req_id]
            if pooled and req_id in pooled:  # its answer: it ends, its blocks freed, with no token
                request.status = RequestStatus.FINISHED_STOPPED
                self.running.remove(request)
                self._free_request(request)
                outputs.append(EngineCoreOutput(req_id, [], "stop", pooled=pooled[req_id]))
                continue
            if not new_ids:
                continue  # a prefill chunk: nothing to report yet
            prompt_logprobs = None  # the prompt's, sent once with its first token
            if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
                prompt_logprobs, request.prompt_logprob_entries = [None, *request.prompt_logprob_entries], []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Rejected drafts' KV slots stay allocated; rewinding progress makes the next
                # step write over them.
                num_accepted = len(new_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.observe(len(drafts), num_accepted)
            kept, so_request = [], request.structured_output_request
            for token in new_ids:  # the grammar first: a token it refuses is never output
                failed = so_request and so_request.advance(token, request.sampling_params._eos_token_ids)
                if failed:
                    request.status, request.stop_reason = RequestStatus.FINISHED_ERROR, failed
                    break
                request.append_output_token(token)
                kept.append(token)
                if request.check_stop(self.max_model_len):
                    break
            if so_request is not None and not request.is_finished and so_request.complete(request):
                request.status = RequestStatus.FINISHED_STOPPED
            logprobs = None
            if runner_output.logprobs is not None and runner_output.logprobs[idx] is not None:
                logprobs = runner_output.logprobs[idx][: len(kept)]
            kv_params = None
            finish_reason = None
            if request.is_finished:
                finish_reason = request.status.finish_reason
                self.running.remove(request)
                kv_params = self._free_request(request)
            outputs.append(EngineCoreOutput(
                request_id=req_id, new_token_ids=kept, finish_reason=finish_reason, stop_reason=request.stop_reason,
                new_logprobs=logprobs, num_cached_tokens=max(request.num_cached_tokens, 0),
                kv_transfer_params=kv_params, prompt_logprobs=prompt_logprobs))
        return outputs

    # ---- introspection ------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_work(self) -> bool:
        """Whether a step is needed: requests to run, finished ones the workers (and their
        KV connector) have not heard of yet, or blocks held for an export in progress."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids) or (
            self.remote_kv is not None and bool(self.remote_kv.sending))
