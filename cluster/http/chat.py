"""`POST /v1/chat/completions`: messages rendered with the model's chat template into a Job
whose answer is the chat response (or its SSE chunks)."""

from __future__ import annotations

import dataclasses
import inspect
import time
import uuid

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError, rejecting
from cluster.http.openai_models import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
    builder,
)
from cluster.http.protocol import ChatCompletionRequest
from cluster.http.served_model import Job, ServedModel
from cluster.http.tools import ToolPlan, message_tool_calls, plain_conversation, supports_tools
from engine.errors import ParameterError
from engine.multimodal.media import MAX_IMAGE_PIXELS, load_image
from engine.parallel_sampling import child_requests
from engine.sampling_params import SamplingParams

make_chunk = builder(ChatCompletionChunk)


def load_images(allowed_local_media_path: str | None, image_limit: int | None, body: ChatCompletionRequest,
                max_pixels: int = MAX_IMAGE_PIXELS) -> list:
    """The request's images, decoded here (the ingress) so a bad one is a 400 naming its
    part; nothing is fetched from the network. `image_limit`: the model's images per prompt
    (limit_mm_per_prompt), None for a text-only model. The count is checked before any image
    is decoded: a request over it costs no decoding."""
    urls = body.image_urls()
    if not urls:
        return []
    if image_limit is None:
        raise OpenAIError(400, "this model is text-only: image_url content parts are not accepted",
                          param=urls[0][0])
    if len(urls) > image_limit:
        raise OpenAIError(400, f"at most {image_limit} images per request (limit_mm_per_prompt), got {len(urls)}",
                          param="messages")
    images = []
    for param, url in urls:
        try:
            images.append(load_image(url, allowed_local_media_path, max_pixels))
        except ParameterError as e:
            raise OpenAIError(400, str(e), param=param) from e
    return images


def template_kwargs(tokenizer, kwargs: dict | None) -> dict | None:
    """The client's chat_template_kwargs; apply_chat_template's own parameters (`tokenize`,
    `chat_template`, `tools`, ...) are the server's to set, not the request's."""
    own = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    clash = sorted(own & set(kwargs or ()))
    if clash:
        raise OpenAIError(400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs")
    return kwargs


def render(tokenizer, body, template_kwargs: dict | None = None, plan: ToolPlan | None = None
           ) -> tuple[str, list[int]]:
    """(text, token ids) of the conversation through the model's chat template. `body`: a
    ChatCompletionRequest, or /tokenize's request (cluster.http.tokenize), which must count
    exactly as this route does; `template_kwargs`: extra variables for the template; `plan`:
    the request's tools (cluster.http.tools), shown by the template or, where it cannot, by a
    system message written here."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conv, kwargs = body.conversation(), dict(template_kwargs or {})
    if supports_tools(tokenizer):
        if plan is not None and plan.template_tools() is not None:
            kwargs["tools"] = plan.template_tools()
    elif plan is not None or any("tool_calls" in m or "tool_call_id" in m for m in conv):
        conv = plain_conversation(conv, plan)
    try:
        text = tokenizer.apply_chat_template(
            conv, tokenize=False, **kwargs,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message)
    except Exception as e:  # template errors are the caller's messages' fault
        raise OpenAIError(400, f"could not apply the chat template: {e}", param="messages") from e
    return text, tokenizer.encode(text, add_special_tokens=False)  # the template has its specials


def chat_job(served: ServedModel, body: ChatCompletionRequest, cached_details: bool | None = None) -> Job:
    """`cached_details`: usage with prompt_tokens_details (None: the server's
    --enable-prompt-tokens-details)."""
    details = served.prompt_tokens_details if cached_details is None else cached_details
    lora = served.check_model(body.model)
    with rejecting(body):
        served.check_limits(body)
        params = body.sampling_params(served.strict_schemas)
        body.check_tool_messages()
        plan = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls, served.tool_parser,
                           served.enable_auto_tool_choice, served.strict_schemas)
        params = _with_tools(params, plan)
    mm = served.processor.mm_processor
    images = load_images(served.allowed_local_media_path, None if mm is None else mm.limit, body,
                         served.limits.max_image_pixels)
    text, ids = render(served.tokenizer, body, template_kwargs(served.tokenizer, body.chat_template_kwargs), plan)
    params = _after_thinking(served, params, text)
    with rejecting(body):
        request = served.request(ids, params, text, images, lora, body.priority, body.cache_salt)
    ids = request.prompt_token_ids  # image placeholders expanded
    request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    model, n_logprobs = body.model, body.num_logprobs  # the base model's name or an adapter's

    def logprobs(token_ids, positions) -> ChatLogprobs | None:
        if n_logprobs is None:
            return None
        return fmt.chat_logprobs(served.text_of, token_ids, positions or [], n_logprobs)

    def choice(j, out) -> ChatChoice:
        c = out.outputs[0]
        reasoning, answer = reasoner.split(c.text) if reasoner is not None else (None, c.text)
        # Tool calls are parsed from the answer after the reasoning, as vLLM does.
        content, calls = plan.parse(answer or "") if plan is not None else (answer, [])
        if plan is not None and reasoner is not None and answer is None:
            content = None
        message = ChatCompletionMessage(reasoning_content=reasoning if body.include_reasoning else None,
                                        content=content, tool_calls=message_tool_calls(calls) if calls else None)
        finish = plan.finish_reason(calls, c.finish_reason) if plan is not None else c.finish_reason
        return ChatChoice(index=j, message=message, logprobs=logprobs(c.token_ids, c.logprobs),
                          finish_reason=finish, stop_reason=c.stop_reason)

    def whole(finals) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id, created=int(time.time()), model=model,
            choices=[choice(j, out) for j, out in enumerate(finals)],
            usage=Usage.of(len(ids), sum(len(out.outputs[0].token_ids) for out in finals),
                           finals[0].num_cached_tokens if details else None),
            prompt_logprobs=(fmt.vllm_prompt_logprobs(finals[0].prompt_logprobs)
                             if body.prompt_logprobs is not None else None))

    def deltas(j, out, finish) -> tuple[list[DeltaMessage | dict], str | None]:
        """This output's deltas (text, or tool-call pieces) and its finish reason. Text is a
        DeltaMessage's fields, made one by make_chunk's call."""
        if plan is None and reasoner is None:
            return ([{"content": out.delta_text}] if out.delta_text or finish is None else [{}]), finish
        pieces = [("content", out.delta_text)] if out.delta_text else []
        if reasoner is not None:
            pieces = thinking[j].feed(out.delta_text) if out.delta_text else []
            if finish is not None:
                pieces += thinking[j].finish()
        parts: list = []
        for kind, text in pieces:
            if kind == "reasoning":
                if body.include_reasoning:
                    parts.append({"reasoning_content": text})
            elif plan is None:
                parts.append({"content": text})
            else:
                parts += streamers[j].feed(text)
        if finish is not None and plan is not None:
            parts += streamers[j].finish()
            finish = plan.finish_reason([None] * streamers[j].calls, finish)
        return parts or ([{}] if finish is not None else []), finish

    def chunk(choices: list[dict], usage: Usage | None = None) -> ChatCompletionChunk:
        """A chunk whose choices are ChatChunkChoice's fields (a chunk goes out per token)."""
        return make_chunk({"id": request_id, "created": int(time.time()), "model": model, "choices": choices,
                           "usage": usage})

    async def chunks(merged):
        n_gen = [0] * n
        cached = 0  # the prompt's, as its engine reported it (every sample shares the prompt)
        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in range(n)])
        async for j, out in merged:
            c = out.outputs[0]
            n_gen[j], cached = len(c.token_ids), max(cached, out.num_cached_tokens)
            finish = c.finish_reason if out.finished else None
            if not out.delta_text and not out.delta_token_ids and finish is None:
                continue
            parts, finish = deltas(j, out, finish)
            lp = logprobs(out.delta_token_ids, out.delta_logprobs)
            if not parts and lp is None:
                continue  # text a tool parser holds back for now
            parts = parts or [{}]
            for k, delta in enumerate(parts):
                last = k == len(parts) - 1
                yield chunk([{"index": j, "delta": delta, "logprobs": lp if k == 0 else None,
                              "finish_reason": finish if last else None}],
                            Usage.of(len(ids), n_gen[j], cached if details else None)
                            if body.continuous_usage and last else None)
        if body.include_usage:
            yield chunk([], Usage.of(len(ids), sum(n_gen), cached if details else None))

    # `n` > 1: n requests of the same prompt (engine.parallel_sampling); choice j is sample j.
    n = params.n
    streamers = [plan.streamer() for _ in range(n)] if plan is not None else []
    # A grammar from the first token (the model was not to think) leaves no thinking to split.
    so = params.structured_outputs
    reasoner = served.reasoning_parser if so is None or so.after_tokens else None
    thinking = [reasoner.stream() for _ in range(n)] if reasoner is not None else []
    return Job(child_requests(request), request_id, body.stream, chunks, whole, n)


def _after_thinking(served: ServedModel, params: SamplingParams, prompt_text: str) -> SamplingParams:
    """A reasoning model's grammar (structured outputs, a forced tool call) starts after its
    `</think>`, as vLLM's does, when the prompt leaves the model to think."""
    reasoner, so = served.reasoning_parser, params.structured_outputs
    if reasoner is None or so is None or not reasoner.thinks_after(prompt_text):
        return params
    end = tuple(served.tokenizer.encode(reasoner.end, add_special_tokens=False))
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after_tokens=end))


def _with_tools(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """The params a tool plan needs: its grammar for a forced call; the special tokens some
    parsers read (mistral's [TOOL_CALLS]) kept in the text."""
    if plan is None:
        return params
    constraint = plan.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ParameterError("tool_choice", "a forced tool call (tool_choice required or named) cannot be "
                                 "combined with response_format or structured outputs")
        params = dataclasses.replace(params, structured_outputs=constraint)
    if plan.mode == "auto" and plan.parser.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
