"""`POST /v1/completions`: prompts (a string, token ids, or a batch of either) into a Job whose
answer is the legacy completions response (or its SSE chunks)."""

from __future__ import annotations

import dataclasses
import uuid

from cluster.http import openai_format as fmt
from cluster.http.errors import rejecting
from cluster.http.front_end import FrontEnd, Job
from cluster.http.protocol import CompletionRequest
from engine.outputs import RequestOutput
from engine.parallel_sampling import child_params
from engine.processor import LORA_FIELD


def completion_job(front: FrontEnd, body: CompletionRequest) -> Job:
    lora = front.check_model(body.model)
    prompts, per_prompt = [], []
    with rejecting(body):
        params = body.sampling_params()
        for p in body.prompts():
            ids = front.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            ids, prompt_params = front.prepare(ids, params, lora=lora)  # token ids range-checked here
            per_prompt.append(prompt_params)
            text = p if isinstance(p, str) else front.tokenizer.decode(ids)
            prompts.append({"prompt": text, "prompt_token_ids": ids} if lora is None else
                           {"prompt": text, "prompt_token_ids": ids, LORA_FIELD: lora})
    request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    model, n_logprobs, echo = body.model, body.logprobs, body.echo  # the base model's name or an adapter's
    # max_tokens=0 (with echo) scores the prompt: the engine's one token is left out.
    scoring = body.max_tokens == 0
    # `n` > 1: each prompt's n samples run as n requests; choice index = prompt index * n + j.
    n = params.n
    prompts = [p for p in prompts for _ in range(n)]
    per_prompt = [c for p in per_prompt for c in child_params(p)]
    if echo and n_logprobs is not None:
        # Every choice echoes its prompt with logprobs, not only the first sample's.
        per_prompt = [dataclasses.replace(c, prompt_logprobs=params.prompt_logprobs) for c in per_prompt]

    def logprobs(i, out: RequestOutput, ids: list[int], positions, offset: int, with_prompt: bool):
        """The choice's logprobs object over (the echoed prompt and) `ids`."""
        if n_logprobs is None:
            return None
        if not with_prompt:
            return fmt.completion_logprobs(front.text_of, ids, positions or [], n_logprobs, offset)
        prompt_ids = prompts[i]["prompt_token_ids"]
        prompt_pos = fmt.plain_positions(out.prompt_logprobs or [None] * len(prompt_ids))
        lp = fmt.completion_logprobs(front.text_of, prompt_ids, prompt_pos, n_logprobs, 0)
        rest = fmt.completion_logprobs(front.text_of, ids, positions or [], n_logprobs, offset)
        return {k: lp[k] + rest[k] for k in lp}

    def choice(i, out: RequestOutput, text: str, lp, finish, with_prompt_logprobs: bool = True) -> dict:
        c = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
             "stop_reason": out.outputs[0].stop_reason if finish else None}
        if body.prompt_logprobs is not None and with_prompt_logprobs:
            c["prompt_logprobs"] = fmt.vllm_prompt_logprobs(out.prompt_logprobs)
        return c

    def whole(finals):
        choices, n_prompt, n_gen = [], 0, 0
        for i, out in enumerate(finals):
            c = out.outputs[0]
            ids, positions, text = ([], [], "") if scoring else (c.token_ids, c.logprobs, c.text)
            prefix = prompts[i]["prompt"] if echo else ""
            lp = logprobs(i, out, ids, positions, len(prefix), echo)
            choices.append(choice(i, out, prefix + text, lp, c.finish_reason))
            n_prompt += len(out.prompt_token_ids) if i % n == 0 else 0  # once per prompt, as OpenAI
            n_gen += len(ids)
        return fmt.response_object("text_completion", request_id, model, choices, fmt.usage(n_prompt, n_gen))

    def echo_chunk(i, out: RequestOutput | None) -> dict:
        text = prompts[i]["prompt"]
        lp = None if out is None else logprobs(i, out, [], [], len(text), True)
        return fmt.response_object("text_completion", request_id, model, [
            {"index": i, "text": text, "logprobs": lp, "finish_reason": None}], None, True)

    async def chunks(merged):
        offsets = [0] * len(prompts)
        counts = [[len(p["prompt_token_ids"]), 0] for p in prompts]
        # The prompt's logprobs come with its first output: an echo that carries them waits for it.
        echo_first = echo and n_logprobs is not None
        echoed = [not echo_first] * len(prompts)
        if echo:
            for i, p in enumerate(prompts):
                offsets[i] = len(p["prompt"])
                if not echo_first:
                    yield echo_chunk(i, None)
        first = [True] * len(prompts)  # vLLM's prompt_logprobs go in a choice's first chunk only
        async for i, out in merged:
            if not echoed[i]:
                echoed[i] = True
                yield echo_chunk(i, out)
            c = out.outputs[0]
            plp, first[i] = first[i], False
            finish = c.finish_reason if out.finished else None
            if scoring:
                if finish is not None:
                    yield fmt.response_object("text_completion", request_id, model,
                                              [choice(i, out, "", None, finish, plp)], None, True)
                continue
            counts[i][1] = len(c.token_ids)
            if not out.delta_text and not out.delta_token_ids and finish is None:
                continue
            lp = logprobs(i, out, out.delta_token_ids, out.delta_logprobs, offsets[i], False)
            ch = choice(i, out, out.delta_text, lp, finish, plp)
            offsets[i] += len(out.delta_text)
            u = fmt.usage(*counts[i]) if body.continuous_usage else None
            yield fmt.response_object("text_completion", request_id, model, [ch], u, True)
        if body.include_usage:
            yield fmt.response_object("text_completion", request_id, model, [], fmt.usage(
                sum(c[0] for c in counts[::n]), sum(c[1] for c in counts)), True)

    return Job(prompts, per_prompt, request_id, body.stream, chunks, whole, n)
