"""OpenAI request bodies (plus vLLM's extra sampling fields) and their mapping to SamplingParams.

Pydantic checks types and shapes; the value ranges are checked once, by SamplingParams and
the engine's InputProcessor. Fields OpenAI defines but pdserve does not implement are
rejected rather than silently ignored (a client relying on them would get wrong answers).
Every rejection is a `ParameterError` naming an engine-side field; `param(field)` says which
field of this request that is, so the ingress answers a 400 with OpenAI's `param`.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cluster.http.structured_fields import GUIDED, response_format_params
from engine.errors import ParameterError
from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from engine.structured_output import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    # Unknown fields are ignored, as OpenAI's and vLLM's servers do.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's spec makes most optional fields nullable (`"n": null`, `"stream": null`,
        ...) and clients send them so: an explicit null is the field's default — except
        `max_tokens`, where null means "up to the context", as in vLLM."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if not (v is None and k != "max_tokens" and k in cls.model_fields
                            and cls.model_fields[k].default is not None)}
        return data

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # vLLM's: lower runs first under --scheduling-policy priority; a salt keeps this request's
    # prefix-cache entries apart from other tenants'.
    priority: int = 0
    cache_salt: str | None = None
    # Structured outputs: vLLM's field, OpenAI's response_format, and the legacy guided_*.
    structured_outputs: dict | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """Raise a ParameterError on the first field set to something pdserve cannot do."""

    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise ParameterError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        return out

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, strict_schemas: bool = True) -> SamplingParams:
        """This request's SamplingParams; raises ParameterError naming the field when a
        feature is unsupported (`n` > 1 included) or a value is out of range.
        `strict_schemas`: the server's reading of response_format schemas
        (cluster.http.structured_config)."""
        self.check_supported()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=self.max_new_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_ids(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(strict_schemas),
        )

    def _structured_sources(self) -> list[str]:
        """The request fields that ask for structured output (response_format "text" does not)."""
        rf = self.response_format
        text = rf is None or rf.get("type", "text") == "text"
        return [f for f in ("structured_outputs", "response_format", *GUIDED)
                if getattr(self, f) is not None and not (f == "response_format" and text)]

    def structured_outputs_params(self, strict_schemas: bool = True) -> StructuredOutputsParams | None:
        """The one constraint this request asks for; ParameterError when it asks for more than
        one or the one is malformed (the field is `structured_outputs`, mapped by `param`)."""
        sources = self._structured_sources()
        if not sources:
            return None
        if len(sources) > 1:
            raise ParameterError(sources[1], f"at most one of {', '.join(sources)} may be set")
        source = sources[0]
        if source in GUIDED:
            return StructuredOutputsParams(**{GUIDED[source]: getattr(self, source)})
        if source == "response_format":
            return response_format_params(self.response_format, strict_schemas)
        unknown = set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise ParameterError("structured_outputs", f"structured_outputs has unknown fields {sorted(unknown)}")
        return StructuredOutputsParams(**self.structured_outputs)

    def param(self, field: str) -> str:
        """The request field (OpenAI's `param`) that a ParameterError's `field` came from."""
        if field == "structured_outputs":
            return (self._structured_sources() or [field])[0]
        return field

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _prompt_kind(value) -> str:
    """The prompt's shape, from its first item: a plain union tries each shape in turn, and a
    shape that fails fails on every item (seconds for a batch of a million prompts)."""
    first = value[0] if isinstance(value, list) and value else None
    return ("text" if isinstance(value, str) else "texts" if isinstance(first, str)
            else "batch" if isinstance(first, list) else "ids")


Prompt = Annotated[Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")] | Annotated[list[int], Tag("ids")]
                   | Annotated[list[list[int]], Tag("batch")], Discriminator(_prompt_kind)]


class CompletionRequest(_Sampling):
    # Prompts per request (--max-pending-requests, set by this process's ingress): counted first.
    max_prompts: ClassVar[int] = 1024
    prompt: Prompt
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _count_prompts(cls, value):
        if _prompt_kind(value) in ("texts", "batch") and len(value) > cls.max_prompts:
            raise ValueError(f"the request holds {len(value)} prompts; at most {cls.max_prompts} per request "
                             "(--max-pending-requests)")
        return value

    def check_supported(self) -> None:
        if self.suffix:
            raise ParameterError("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise ParameterError("best_of", "best_of must be 1")
        if self.max_tokens == 0 and not self.echo:
            raise ParameterError("max_tokens", "max_tokens must be an integer >= 1 (0 only with echo, "
                                 "to score the prompt), got 0")
        super().check_supported()

    @property
    def max_new_tokens(self) -> int | None:
        # max_tokens=0 (with echo): the engine samples one token, which the answer leaves out.
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (its logprobs are part of the answer)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def param(self, field: str) -> str:
        if field == "prompt_logprobs" and self.prompt_logprobs is None:
            return "logprobs"  # echo asked for them through logprobs
        return super().param(field)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a string, a token list, or a batch of either. An
        empty list is one empty prompt, which the engine's own check rejects."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None  # accepted and ignored: the model's processor fixes the size


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | ImageURLPart] | None = None
    name: str | None = None
    # An assistant's calls ([{"id", "type": "function", "function": {"name", "arguments"}}]) and
    # a tool message's answer to one of them.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        """Only an assistant message may have null (or no) content, as in OpenAI's API: its
        tool_calls say what it did. Any other role's null would reach the template as an empty
        turn the client never wrote."""
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("null_content", "a {role} message needs content (a string or a list of "
                                      "content parts), got null", {"role": self.role})
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def template_content(self) -> str | list[dict]:
        """What the chat template sees: the text, or (with images) the parts in order, an
        image as {"type": "image"} for the template to place the model's image token."""
        if not isinstance(self.content, list) or not any(isinstance(p, ImageURLPart) for p in self.content):
            return self.text()
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in self.content]

    def image_urls(self) -> list[tuple[int, str]]:
        """(content index, url) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, p.image_url.url) for j, p in enumerate(self.content) if isinstance(p, ImageURLPart)]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content (--reasoning-parser)

    def check_supported(self) -> None:
        if self.stream and self.prompt_logprobs is not None:
            raise ParameterError("prompt_logprobs", "prompt_logprobs is not available when stream is true "
                                 "(as vLLM's chat)")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs requires logprobs=true")
        super().check_supported()

    def param(self, field: str) -> str:
        """The engine's prompt is the rendered `messages`, its logprobs count `top_logprobs`,
        its max_tokens whichever of max_tokens / max_completion_tokens the client sent."""
        if field in ("prompt", "multi_modal_data"):
            return "messages"
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param(field)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them: a call's JSON arguments as an object
        (templates print them with `tojson`), a tool answer with the id it answers."""
        conv = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.template_content()}
            if m.tool_calls:
                msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            conv.append(msg)
        return conv

    def check_tool_messages(self) -> None:
        """Every tool message answers a call an earlier assistant message made."""
        ids: set[str] = set()
        for i, m in enumerate(self.messages):
            for c in m.tool_calls or []:
                if not isinstance(c, dict) or not isinstance(c.get("function"), dict) or not c["function"].get("name"):
                    raise ParameterError("messages", f"messages[{i}].tool_calls entries must be "
                                         '{"id", "type": "function", "function": {"name", "arguments"}}')
                ids.add(c.get("id"))
            if m.role == "tool" and m.tool_call_id not in ids:
                raise ParameterError("messages", f"messages[{i}] is a tool message whose tool_call_id "
                                     f"{m.tool_call_id!r} matches no earlier tool call")

    def image_urls(self) -> list[tuple[str, str]]:
        """(OpenAI `param` path, url) of every image part, in conversation order."""
        return [(f"messages[{i}].content[{j}].image_url.url", url)
                for i, m in enumerate(self.messages) for j, url in m.image_urls()]


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            pass  # not JSON (or nested past what the parser takes): the template gets the text as sent
    return {**call, "function": fn}
