"""Chat tool calling: a request's `tools` and `tool_choice` as a plan — what the chat template
sees, the grammar that forces calls (`required`, a named tool), and how the generated text
becomes OpenAI `tool_calls` (whole or streamed).

- `none`: the tools are not shown to the model; plain text.
- `auto`: the tools reach the template and the server's tool-call parser (vLLM's
  `--enable-auto-tool-choice --tool-call-parser NAME`, cluster.http.tool_parsers) finds calls in
  the text.
- `required`: the output is constrained (structured outputs, llguidance) to a JSON array of
  `{"name", "parameters"}` objects, each naming an offered tool with arguments valid against
  its schema (at most one call unless `parallel_tool_calls`), as vLLM does.
- a named tool: the output is constrained to that tool's arguments.

A template without tool support (no `tools` in its source) gets the tools in a system message
written here, asking for hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from cluster.http.openai_models import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall
from cluster.http.openai_models import ToolCall as MessageToolCall
from cluster.http.strict_schema import strict
from cluster.http.tool_parsers import ContentDelta, ToolCall, ToolCallDelta, ToolParser
from cluster.http.tool_parsers.base import openai_call_id
from engine.errors import ParameterError
from engine.structured_output import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema

    def openai(self) -> dict:
        """The OpenAI shape chat templates take (`tools=`)."""
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@functools.lru_cache(maxsize=1024)
def _schema_error(schema_json: str) -> str | None:
    """Why a tool's parameters are not a JSON schema (None: they are). Checking one costs ~0.5 ms
    of the event loop, and agents send the same tools with every turn: each distinct schema is
    checked once (keyed by its canonical JSON)."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    schema = json.loads(schema_json)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        return str(e).splitlines()[0]
    return None


def parse_tools(raw: list) -> list[Tool]:
    """The request's function tools; ParameterError("tools") for a malformed one."""
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ParameterError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParameterError("tools", f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        params = _EMPTY_OBJECT if params is None else params
        error = (f"not an object: {params!r}" if not isinstance(params, dict)
                 else _schema_error(json.dumps(params, sort_keys=True)))
        if error is not None:
            raise ParameterError("tools", f"tools[{i}].function.parameters must be a JSON schema: {error}")
        tools.append(Tool(name, fn.get("description"), params))
    seen: set[str] = set()
    dup = sorted({t.name for t in tools if t.name in seen or seen.add(t.name)})  # one pass
    if dup:
        raise ParameterError("tools", f"tool names must be unique, got {dup} more than once")
    return tools


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None  # auto only
    strict_schemas: bool = True  # the server's reading of argument schemas (cluster.http.structured_config)

    @classmethod
    def of(cls, tools_raw: list | None, tool_choice, parallel: bool | None, parser_cls: type | None,
           auto_enabled: bool, strict_schemas: bool = True) -> ToolPlan | None:
        """The request's plan, or None when it has no tools (a tool_choice alone is checked)."""
        if not tools_raw:
            if tool_choice not in (None, "none", "auto"):
                raise ParameterError("tool_choice", "tool_choice requires tools")
            return None
        choice = "auto" if tool_choice is None else tool_choice
        # The choice first: a request this server refuses costs no per-tool work.
        if choice == "auto" and not (auto_enabled and parser_cls is not None):
            raise ParameterError("tool_choice", '"auto" tool choice requires the server to run with '
                                 "--enable-auto-tool-choice and --tool-call-parser")
        tools = tuple(parse_tools(tools_raw))
        named = None
        if isinstance(choice, dict):
            named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(named, str):
                raise ParameterError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                     '{"type": "function", "function": {"name": ...}}')
            if named not in {t.name for t in tools}:
                raise ParameterError("tool_choice", f"tool_choice names {named!r}, which is not among the tools "
                                     f"{[t.name for t in tools]}")
            choice = "named"
        elif choice not in ("none", "auto", "required"):
            raise ParameterError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named "
                                 f"function, got {choice!r}")
        return cls(tools, choice, named, parallel is not False, parser_cls() if choice == "auto" else None,
                   strict_schemas)

    # ---- what the model sees --------------------------------------------------------------
    def template_tools(self) -> list[dict] | None:
        return None if self.mode == "none" else [t.openai() for t in self.tools]

    def system_prompt(self) -> str:
        """The tools for a template that cannot show them (our format, hermes-style)."""
        listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in self.tools)
        return ("You may call one or more functions to help with the user's request. The functions are:\n"
                f"<tools>\n{listed}\n</tools>\n"
                "To call a function, answer with one block per call:\n"
                '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>\n'
                "Each call's result comes back in <tool_response></tool_response>; answer the user with it.")

    def constraint(self) -> StructuredOutputsParams | None:
        # Strict arguments (cluster.http.strict_schema): no keys beyond those a schema lists.
        args = strict if self.strict_schemas else dict  # dict: a copy of the schema as given
        if self.mode == "named":
            named = next(t for t in self.tools if t.name == self.named)
            return StructuredOutputsParams(json=args(named.parameters))
        if self.mode != "required":
            return None
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                           "parameters": args(t.parameters)},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}
        array = {"type": "array", "minItems": 1, "items": item}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    # ---- what the model said --------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole response."""
        if self.mode == "auto":
            out = self.parser.parse(text)
            return out.content, list(out.tool_calls)
        if self.mode == "named":
            return None, [ToolCall(openai_call_id(), self.named, _normal(text))]
        if self.mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls is not None else (text, [])
        return text, []

    def finish_reason(self, calls: list, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a forced named call is "stop")."""
        if calls and self.mode in ("auto", "required") and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


def _normal(text: str) -> str:
    """Arguments as compact JSON when they parse (a length cut leaves the raw text)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def _required_calls(text: str) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [ToolCall(openai_call_id(), c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in items]


class ToolStreamer:
    """One choice's text deltas as chat deltas: content, or OpenAI `tool_calls` chunks (index,
    id and type with the name first, then `arguments` fragments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = plan.parser.stream() if plan.mode == "auto" else None
        self.text = ""  # required: the JSON so far, parsed at the end
        self.named_id: str | None = None
        self.calls = 0

    def feed(self, delta_text: str) -> list[DeltaMessage]:
        if self.stream is not None:
            return self._deltas(self.stream.feed(delta_text))
        if self.plan.mode == "named":
            out = []
            if self.named_id is None:
                self.named_id, self.calls = openai_call_id(), 1
                out.append(_call_delta(0, self.named_id, self.plan.named, ""))
            if delta_text:
                out.append(_call_delta(0, None, None, delta_text))
            return out
        if self.plan.mode == "required":
            self.text += delta_text
            return []
        return [DeltaMessage(content=delta_text)] if delta_text else []

    def finish(self) -> list[DeltaMessage]:
        if self.stream is not None:
            return self._deltas(self.stream.finish())
        if self.plan.mode == "required":
            calls = _required_calls(self.text)
            if calls is None:
                return [DeltaMessage(content=self.text)] if self.text else []
            self.calls = len(calls)
            return [d for i, c in enumerate(calls) for d in (_call_delta(i, c.id, c.name, ""),
                                                            _call_delta(i, None, None, c.arguments))]
        if self.plan.mode == "named" and self.named_id is None:
            return self.feed("")
        return []

    def _deltas(self, items) -> list[DeltaMessage]:
        out = []
        for d in items:
            if isinstance(d, ContentDelta):
                out.append(DeltaMessage(content=d.text))
            elif isinstance(d, ToolCallDelta):
                self.calls = max(self.calls, d.index + 1)
                out.append(_call_delta(d.index, d.id, d.name, d.arguments))
        return out


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str | None) -> DeltaMessage:
    fn = DeltaFunctionCall(name=name, arguments=arguments) if name is not None or arguments is not None else None
    call = DeltaToolCall(index=index, id=call_id, type=None if call_id is None else "function", function=fn)
    return DeltaMessage(tool_calls=[call])


def supports_tools(tokenizer) -> bool:
    """Whether the model's chat template shows tools (it reads a `tools` variable)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def plain_conversation(conv: list[dict], plan: ToolPlan | None) -> list[dict]:
    """The conversation for a template without tool support: the tools (when shown) in a
    system message, each earlier call written out as the hermes text the model was asked for,
    and the results of calls as hermes writes them: a user turn of <tool_response> blocks (a
    "tool" role the template does not know leaves a small model calling the tool again)."""
    out = []
    results_at = None  # index in out of the user turn gathering the current results
    for m in conv:
        if "tool_call_id" in m:
            content = m["content"]
            if isinstance(content, list):  # text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results_at == len(out) - 1:  # results of one turn's calls: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                results_at = len(out)
                out.append({"role": "user", "content": block})
            continue
        if m.get("tool_calls"):
            calls = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"].get("arguments", {})},
                                                         ensure_ascii=False) + "\n</tool_call>"
                            for c in m["tool_calls"])
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            m = {"role": m["role"], "content": (text + "\n" if text else "") + calls}
        out.append(m)
    if plan is not None and plan.template_tools() is not None:
        prompt = plan.system_prompt()
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def message_tool_calls(calls: list[ToolCall]) -> list[MessageToolCall]:
    return [MessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
