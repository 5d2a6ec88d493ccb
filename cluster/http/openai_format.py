"""OpenAI response objects built from engine outputs (completions and chat, plain and streamed)."""

from __future__ import annotations

import json
import time

from engine.outputs import PositionLogprobs, PromptLogprobs


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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


def plain_positions(prompt_logprobs: PromptLogprobs) -> list[PositionLogprobs | None]:
    """Prompt logprobs as the sampled tokens' {token_id: logprob} (None stays None)."""
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in prompt_logprobs]


def vllm_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` response field: per position None or {token id: {logprob,
    rank, decoded_token}} (token ids as JSON keys, strings)."""
    if prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in prompt_logprobs]


def completion_logprobs(text_of: TokenText, token_ids: list[int], positions: list[PositionLogprobs | None],
                        n: int, offset: int) -> dict:
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
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(text_of: TokenText, token_ids: list[int], positions: list[PositionLogprobs], n: int) -> dict:
    content = []
    for tid, pos in zip(token_ids, positions):
        s = text_of(tid)
        content.append({
            "token": s, "logprob": pos.get(tid), "bytes": list(s.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": lp, "bytes": list(text_of(t).encode())}
                             for t, lp in _top(pos, n)],
        })
    return {"content": content}


def response_object(kind: str, request_id: str, model: str, choices: list[dict], usage_: dict | None,
                    chunk: bool = False) -> dict:
    """A completions (`kind="text_completion"`) or chat (`kind="chat.completion"`) response,
    or one streamed chunk of it (chat chunks are "chat.completion.chunk"; a chunk carries
    `usage` only when it has one)."""
    obj = {"id": request_id, "object": f"{kind}.chunk" if chunk and kind == "chat.completion" else kind,
           "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        obj["usage"] = usage_
    return obj
