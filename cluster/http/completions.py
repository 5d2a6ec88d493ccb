"""`POST /v1/completions`: prompts (a string, token ids, or a batch of either) into a Job whose
answer is the legacy completions response (or its SSE chunks)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from cluster.http import openai_format as fmt
from cluster.http.errors import rejecting
from cluster.http.openai_models import (
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    builder,
)
from cluster.http.protocol import CompletionRequest
from cluster.http.served_model import Job, ServedModel
from engine.outputs import RequestOutput
from engine.parallel_sampling import child_requests

make_chunk = builder(CompletionChunk)


def completion_job(served: ServedModel, body: CompletionRequest) -> Job:
    lora = served.check_model(body.model)
    processed = []
    with rejecting(body):
        served.check_limits(body)
        params = body.sampling_params(served.strict_schemas)
        for p in body.prompts():
            if isinstance(p, str):
                request = served.request(served.tokenizer.encode(p, add_special_tokens=True), params, p, lora=lora,
                                         priority=body.priority, cache_salt=body.cache_salt)
            else:  # its text once its ids are known to be in the vocabulary (for echo)
                request = served.request(list(p), params, lora=lora, priority=body.priority,
                                         cache_salt=body.cache_salt)
                request = dataclasses.replace(request, prompt=served.tokenizer.decode(request.prompt_token_ids))
            processed.append(request)
    request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    model, n_logprobs, echo = body.model, body.logprobs, body.echo  # the base model's name or an adapter's
    # max_tokens=0 (with echo) scores the prompt: the engine's one token is left out.
    scoring = body.max_tokens == 0
    # `n` > 1: each prompt's n samples run as n requests; choice index = prompt index * n + j.
    n = params.n
    requests = [sample for r in processed for sample in child_requests(r)]
    if echo and n_logprobs is not None:
        # Every choice echoes its prompt with logprobs, not only the first sample's.
        requests = [dataclasses.replace(r, sampling_params=dataclasses.replace(
            r.sampling_params, prompt_logprobs=params.prompt_logprobs)) for r in requests]

    def logprobs(i, out: RequestOutput, ids: list[int], positions, offset: int,
                 with_prompt: bool) -> CompletionLogprobs | None:
        """The choice's logprobs object over (the echoed prompt and) `ids`."""
        if n_logprobs is None:
            return None
        rest = fmt.completion_logprobs(served.text_of, ids, positions or [], n_logprobs, offset)
        if not with_prompt:
            return rest
        prompt_ids = requests[i].prompt_token_ids
        prompt_pos = fmt.plain_positions(out.prompt_logprobs or [None] * len(prompt_ids))
        return fmt.joined(fmt.completion_logprobs(served.text_of, prompt_ids, prompt_pos, n_logprobs, 0), rest)

    def choice(i, out: RequestOutput, text: str, lp, finish, with_prompt_logprobs: bool = True) -> dict:
        """A CompletionChoice's fields, made into one with the body (make_chunk, or the whole)."""
        plp = body.prompt_logprobs is not None and with_prompt_logprobs
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": out.outputs[0].stop_reason if finish else None,
                "prompt_logprobs": fmt.vllm_prompt_logprobs(out.prompt_logprobs) if plp else None}

    details = served.prompt_tokens_details

    def whole(finals) -> CompletionResponse:
        choices, n_prompt, n_gen, n_cached = [], 0, 0, 0
        for i, out in enumerate(finals):
            c = out.outputs[0]
            ids, positions, text = ([], [], "") if scoring else (c.token_ids, c.logprobs, c.text)
            prefix = requests[i].prompt if echo else ""
            lp = logprobs(i, out, ids, positions, len(prefix), echo)
            choices.append(choice(i, out, prefix + text, lp, c.finish_reason))
            n_prompt += len(out.prompt_token_ids) if i % n == 0 else 0  # once per prompt, as OpenAI
            n_cached += out.num_cached_tokens if i % n == 0 else 0
            n_gen += len(ids)
        return CompletionResponse(id=request_id, created=int(time.time()), model=model, choices=choices,
                                  usage=Usage.of(n_prompt, n_gen, n_cached if details else None))

    def chunk(choices: list[dict], usage: Usage | None = None) -> CompletionChunk:
        """A chunk of these choices (a chunk goes out per token)."""
        return make_chunk({"id": request_id, "created": int(time.time()), "model": model, "choices": choices,
                           "usage": usage})

    def echo_chunk(i, out: RequestOutput | None) -> CompletionChunk:
        text = requests[i].prompt
        lp = None if out is None else logprobs(i, out, [], [], len(text), True)
        return chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": None}])

    async def chunks(merged):
        offsets = [0] * len(requests)
        counts = [[len(r.prompt_token_ids), 0, 0] for r in requests]  # prompt, generated, cached
        # The prompt's logprobs come with its first output: an echo that carries them waits for it.
        echo_first = echo and n_logprobs is not None
        echoed = [not echo_first] * len(requests)
        if echo:
            for i, r in enumerate(requests):
                offsets[i] = len(r.prompt)
                if not echo_first:
                    yield echo_chunk(i, None)
        first = [True] * len(requests)  # vLLM's prompt_logprobs go in a choice's first chunk only
        async for i, out in merged:
            if not echoed[i]:
                echoed[i] = True
                yield echo_chunk(i, out)
            c = out.outputs[0]
            plp, first[i] = first[i], False
            finish = c.finish_reason if out.finished else None
            if scoring:
                if finish is not None:
                    yield chunk([choice(i, out, "", None, finish, plp)])
                continue
            counts[i][1], counts[i][2] = len(c.token_ids), max(counts[i][2], out.num_cached_tokens)
            if not out.delta_text and not out.delta_token_ids and finish is None:
                continue
            lp = logprobs(i, out, out.delta_token_ids, out.delta_logprobs, offsets[i], False)
            ch = choice(i, out, out.delta_text, lp, finish, plp)
            offsets[i] += len(out.delta_text)
            yield chunk([ch], Usage.of(*counts[i][:2], counts[i][2] if details else None)
                        if body.continuous_usage else None)
        if body.include_usage:
            yield chunk([], Usage.of(sum(c[0] for c in counts[::n]), sum(c[1] for c in counts),
                                     sum(c[2] for c in counts[::n]) if details else None))

    return Job(requests, request_id, body.stream, chunks, whole, n)
