"""Engine outputs as the pieces of OpenAI's response bodies (cluster.http.openai_models):
logprobs, vLLM's prompt logprobs, and a body on the wire (JSON, or one SSE event)."""

from __future__ import annotations

from fastapi.responses import Response
from pydantic import BaseModel

from cluster.http.openai_models import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    builder,
)
from engine.outputs import PositionLogprobs
from engine.outputs import PromptLogprobs as EnginePromptLogprobs


def to_json(body: BaseModel) -> str:
    """The body's JSON, compact, non-ASCII as UTF-8 (as Starlette's JSONResponse writes a dict).
    The serializer is called itself: model_dump_json's Python wrapper costs a quarter of a
    streamed chunk's serialization."""
    return body.__pydantic_serializer__.to_json(body).decode()


def sse(body: BaseModel | str) -> str:
    """One `data:` event: a body's JSON, or a literal such as `[DONE]`."""
    return f"data: {body if isinstance(body, str) else to_json(body)}\n\n"


def json_response(body: BaseModel, status_code: int = 200, headers: dict | None = None) -> Response:
    return Response(to_json(body), status_code, headers, media_type="application/json")


class TokenText:
    """Per-token strings for logprobs (each token decoded alone, as vLLM reports them)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s


def _top(position: PositionLogprobs, n: int) -> list[tuple[int, float]]:
    return sorted(position.items(), key=lambda kv: -kv[1])[:n]


def plain_positions(prompt_logprobs: EnginePromptLogprobs) -> list[PositionLogprobs | None]:
    """Prompt logprobs as the sampled tokens' {token_id: logprob} (None stays None)."""
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in prompt_logprobs]


def vllm_prompt_logprobs(prompt_logprobs: EnginePromptLogprobs | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` response field: per position None or {token id: {logprob,
    rank, decoded_token}} (token ids as JSON keys, strings)."""
    if prompt_logprobs is None:
        return None
    return [None if e is None else {
        str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
        for t, lp in e.items()} for e in prompt_logprobs]


def completion_logprobs(text_of: TokenText, token_ids: list[int], positions: list[PositionLogprobs | None],
                        n: int, offset: int) -> CompletionLogprobs:
    """The legacy completions `logprobs` object for these tokens; `offset` is where the first
    token's text starts in the choice's text. A None position (an echoed prompt's first
    token) has null logprobs, as OpenAI's."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        s = text_of(tid)
        tokens.append(s)
        text_offset.append(offset)
        offset += len(s)
        if pos is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(pos.get(tid))
        # As vLLM: the top n plus the sampled token (up to n + 1 entries).
        top = {text_of(t): lp for t, lp in _top(pos, n)} if n else {}
        if tid in pos:
            top.setdefault(s, pos[tid])
        top_logprobs.append(top or None)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=text_offset)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """One logprobs object over `first`'s tokens followed by `then`'s (an echoed prompt's and
    the generated ones)."""
    return CompletionLogprobs(tokens=first.tokens + then.tokens, token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


_make_chat_logprobs = builder(ChatLogprobs)


def _entry(text_of: TokenText, token_id: int, logprob: float | None) -> dict:
    s = text_of(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode())}


def chat_logprobs(text_of: TokenText, token_ids: list[int], positions: list[PositionLogprobs], n: int) -> ChatLogprobs:
    """Chat's `logprobs` of these tokens, each with its top n. Built in one call from plain
    values, as a streamed chunk is (cluster.http.openai_models.builder): it is built per token."""
    return _make_chat_logprobs({"content": [{**_entry(text_of, tid, pos.get(tid)),
                                             "top_logprobs": [_entry(text_of, t, lp) for t, lp in _top(pos, n)]}
                                            for tid, pos in zip(token_ids, positions)]})
