"""Factories for CPU-only scheduler tests, after vLLM's tests/v1/core helpers.

No model and no torch: a Scheduler over a real KVCacheManager, Requests built from plain
token ids, and a fake model runner that samples one token for every request whose scheduled
tokens reach the end of its known tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sched.output import (
    EngineCoreOutput,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.sched.scheduler import Scheduler

EOS_TOKEN_ID = 2
# What the fake runner samples unless told otherwise: never EOS, never a prompt token.
DEFAULT_SAMPLED_TOKEN_ID = 1

# Each request built without explicit prompt tokens gets a prompt no other request shares,
# so prefix caching only ever hits where a test asks for it.
_prompt_bases = itertools.count(1)

TokenChoice = int | Mapping[str, int] | Callable[[Request], int]


def create_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    num_blocks: int = 10_000,
    block_size: int = 4,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    max_model_len: int = 4096,
    enable_prefix_caching: bool = False,
    connector=None,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=policy,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, kv_cache_manager, max_model_len, connector)


def create_request(
    request_id: str,
    prompt_len: int = 8,
    max_tokens: int = 16,
    *,
    prompt_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
) -> Request:
    if prompt_token_ids is None:
        base = 1000 * next(_prompt_bases)
        prompt_token_ids = [base + i for i in range(prompt_len)]
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )
    if eos_token_id is not None:
        params = dataclasses.replace(params, _eos_token_ids=(eos_token_id,))
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=arrival_time,
    )


def create_requests(
    num_requests: int,
    prompt_len: int = 8,
    max_tokens: int = 16,
    *,
    id_prefix: str = "req",
    priorities: list[int] | None = None,
    **kwargs,
) -> list[Request]:
    """Requests `{id_prefix}-{i}` with arrival_time i (so FCFS and priority ties are stable)."""
    return [
        create_request(
            f"{id_prefix}-{i}",
            prompt_len,
            max_tokens,
            priority=priorities[i] if priorities else 0,
            arrival_time=float(i),
            **kwargs,
        )
        for i in range(num_requests)
    ]


def _choose_token(request: Request, tokens: TokenChoice | None) -> int:
    if tokens is None:
        return DEFAULT_SAMPLED_TOKEN_ID
    if isinstance(tokens, int):
        return tokens
    if isinstance(tokens, Mapping):
        return tokens.get(request.request_id, DEFAULT_SAMPLED_TOKEN_ID)
    return tokens(request)


def make_runner_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, tokens: TokenChoice | None = None,
    kv_connector_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """Fake the model runner for one step.

    Call right after schedule() (which has already advanced num_computed_tokens): a request
    samples one token only if this step's tokens reach the end of its known tokens; a
    prefill chunk that stops short samples nothing. `tokens` picks the sampled id: one id
    for all, a request_id -> id mapping, or a function of the Request.
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens >= request.num_tokens:
            sampled.append([_choose_token(request, tokens)])
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_connector_output)


def step(
    scheduler: Scheduler, tokens: TokenChoice | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step: schedule -> fake execute -> update_from_output."""
    scheduler_output = scheduler.schedule()
    runner_output = make_runner_output(scheduler, scheduler_output, tokens)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def run_until_done(
    scheduler: Scheduler, tokens: TokenChoice | None = None, max_steps: int = 1000
) -> list[tuple[SchedulerOutput, list[EngineCoreOutput]]]:
    """Step until nothing is waiting or running; fails instead of looping forever."""
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return steps
        steps.append(step(scheduler, tokens))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
