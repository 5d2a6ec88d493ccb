"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

The ingress's own tokenizer answers them; no engine is asked. Messages go through the chat
route's own rendering (cluster.http.chat.render), so `count` for a conversation is the
`prompt_tokens` that /v1/chat/completions reports for it. lm-eval's `tokenizer_backend=remote`
client reads `tokens`, `prompt`, and `eos_token`, `bos_token`, `pad_token`, `chat_template`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import AddedToken

from cluster.http.chat import render, template_kwargs
from cluster.http.errors import OpenAIError
from cluster.http.openai_models import DetokenizeResponse, TokenizeResponse, TokenizerInfoResponse
from cluster.http.protocol import ChatMessage
from cluster.http.served_model import ServedModel

# init_kwargs that are file paths on the server, not configuration.
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file")


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) as one
    body, so that a 400 names the field at fault rather than a union member."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Default: true for a prompt, false for messages (the chat template adds its own).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.template_content()} for m in self.messages]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _check_model(served: ServedModel, model: str | None) -> None:
    if model:  # optional here, as in vLLM
        served.check_model(model)


def _chat_ids(tokenizer, body: TokenizeRequest) -> list[int]:
    images = [f"messages[{i}].content[{j}]" for i, m in enumerate(body.messages) for j, _ in m.image_urls()]
    if images:
        raise OpenAIError(400, "/tokenize takes text content only, not images", param=images[0])
    text, ids = render(tokenizer, body, template_kwargs(tokenizer, body.chat_template_kwargs))
    return tokenizer.encode(text, add_special_tokens=True) if body.add_special_tokens else ids


def tokenize(served: ServedModel, body: TokenizeRequest) -> TokenizeResponse:
    """`{count, max_model_len, tokens, token_strs}` of a prompt or a conversation."""
    _check_model(served, body.model)
    tokenizer = served.tokenizer
    if body.messages is not None and body.prompt is not None:
        raise OpenAIError(400, "give either 'prompt' or 'messages', not both", param="messages")
    if body.messages is not None:
        ids = _chat_ids(tokenizer, body)
    elif body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        raise OpenAIError(400, "missing required field 'prompt' (or 'messages' for a conversation)",
                          param="prompt")
    return TokenizeResponse(count=len(ids), max_model_len=served.processor.max_model_len, tokens=ids,
                            token_strs=tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None)


def detokenize(served: ServedModel, body: DetokenizeRequest) -> DetokenizeResponse:
    """`{prompt}`: the text of the ids, special tokens included (as vLLM decodes them)."""
    _check_model(served, body.model)
    vocab = len(served.tokenizer)
    # The model's embedding may be padded past the tokenizer; those ids have no text, and the
    # tokenizer would silently drop them.
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return DetokenizeResponse(prompt=served.tokenizer.decode(body.tokens))


def _jsonable(value):
    if isinstance(value, AddedToken):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(served: ServedModel) -> TokenizerInfoResponse:
    """The tokenizer's configuration (its tokenizer_config.json as loaded, as vLLM answers),
    with the special tokens and chat template it actually uses, and the engine's
    `max_model_len` (the tokenizer's own `model_max_length` is often a placeholder)."""
    tok = served.tokenizer
    info = {k: v for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k not in _PATH_KEYS}
    info.update(
        tokenizer_class=type(tok).__name__,
        bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token,
        chat_template=getattr(tok, "chat_template", None),
        model_max_length=tok.model_max_length,
        max_model_len=served.processor.max_model_len,
    )
    return TokenizerInfoResponse.model_validate(_jsonable(info))
