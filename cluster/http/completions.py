"""`POST /v1/completions`: prompts (a string, token ids, or a batch of either) into a Job whose
answer is the legacy completions response (or its SSE chunks)."""

from __future__ import annotations

import uuid

from cluster.http import openai_format as fmt
from cluster.http.errors import rejecting
from cluster.http.front_end import FrontEnd, Job
from cluster.http.protocol import CompletionRequest
from engine.outputs import RequestOutput
from engine.parallel_sampling import child_params


def completion_job(front: FrontEnd, body: CompletionRequest) -> Job:
    front.check_model(body.model)
    prompts, per_prompt = [], []
    with rejecting(body):
        params = body.sampling_params()
        for p in body.prompts():
            ids = front.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            ids, prompt_params = front.prepare(ids, params)  # token ids range-checked here
            per_prompt.append(prompt_params)
            text = p if isinstance(p, str) else front.tokenizer.decode(ids)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
    request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    model, n_logprobs, echo = front.model_name, body.logprobs, body.echo
    # `n` > 1: each prompt's n samples run as n requests; choice index = prompt index * n + j.
    n = params.n
    prompts = [p for p in prompts for _ in range(n)]
    per_prompt = [c for p in per_prompt for c in child_params(p)]

    def choice(i, out: RequestOutput, text: str, ids: list[int], positions, offset: int, finish) -> dict:
        lp = (fmt.completion_logprobs(front.text_of, ids, positions or [], n_logprobs, offset)
              if n_logprobs is not None else None)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": out.outputs[0].stop_reason if finish else None}

    def whole(finals):
        choices, n_prompt, n_gen = [], 0, 0
        for i, out in enumerate(finals):
            c = out.outputs[0]
            prefix = prompts[i]["prompt"] if echo else ""
            choices.append(choice(i, out, prefix + c.text, c.token_ids, c.logprobs, len(prefix), c.finish_reason))
            n_prompt += len(out.prompt_token_ids) if i % n == 0 else 0  # once per prompt, as OpenAI
            n_gen += len(c.token_ids)
        return fmt.response_object("text_completion", request_id, model, choices, fmt.usage(n_prompt, n_gen))

    async def chunks(merged):
        offsets = [0] * len(prompts)
        counts = [[len(p["prompt_token_ids"]), 0] for p in prompts]
        if echo:
            for i, p in enumerate(prompts):
                offsets[i] = len(p["prompt"])
                yield fmt.response_object("text_completion", request_id, model, [
                    {"index": i, "text": p["prompt"], "logprobs": None, "finish_reason": None}], None, True)
        async for i, out in merged:
            c = out.outputs[0]
            counts[i][1] = len(c.token_ids)
            finish = c.finish_reason if out.finished else None
            if not out.delta_text and not out.delta_token_ids and finish is None:
                continue
            ch = choice(i, out, out.delta_text, out.delta_token_ids, out.delta_logprobs, offsets[i], finish)
            offsets[i] += len(out.delta_text)
            u = fmt.usage(*counts[i]) if body.continuous_usage else None
            yield fmt.response_object("text_completion", request_id, model, [ch], u, True)
        if body.include_usage:
            yield fmt.response_object("text_completion", request_id, model, [], fmt.usage(
                sum(c[0] for c in counts[::n]), sum(c[1] for c in counts)), True)

    return Job(prompts, per_prompt, request_id, body.stream, chunks, whole, n)
