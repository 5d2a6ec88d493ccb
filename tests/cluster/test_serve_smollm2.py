"""The default real model over HTTP: SmolLM2-135M-Instruct (GGUF) under its served name,
answering a chat question with a known fact, and a `response_format` JSON schema with JSON that
validates. Colocated, the cheaper mode on two cores (P/D
with the same engine is covered with the tiny models in test_serve_pd)."""

from __future__ import annotations

import pytest

from engine.models.default_model import DEFAULT_MODEL_TOOL_PARSER
from tests.cluster.helpers import ENGINE, assert_no_leaks
from tests.engine.so_oracles import COUNTRY_SCHEMA, FRANCE_QUESTION, assert_valid_json

APP = "smoltest"
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def app(deploy, smollm2):
    from cluster.launch.app_config import AppConfig
    from cluster.launch.serve_cli import warm_tokenizer_cache
    from engine import EngineArgs

    warm_tokenizer_cache(smollm2)  # as `pdserve serve` does: replicas then skip the conversion
    # No served_model_name: the default model is served under its own name; with the tool flags
    # `pdserve serve` turns on for it when given no --model.
    cfg = AppConfig(engine_args=EngineArgs(model=smollm2, **ENGINE), mode="colocated", app_name=APP,
                    replica_num_cpus=0, enable_auto_tool_choice=True, tool_call_parser=DEFAULT_MODEL_TOOL_PARSER)
    return deploy(cfg)


def test_chat_over_http_answers_the_capital_of_france(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the model ended its answer (EOS), not the limit
    assert_no_leaks(app, APP, {"colocated"})


def test_chat_response_format_json_schema_validates(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    rf = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY_SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": FRANCE_QUESTION}],
                                       max_tokens=64, temperature=0, response_format=rf)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert_valid_json(text, COUNTRY_SCHEMA)
    assert_no_leaks(app, APP, {"colocated"})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_calls_on_a_template_without_tool_support(app):
    """SmolLM2's template shows no tools: they reach the model in a system message; a required
    call still validates, named and streamed."""
    import json

    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER_TOOL], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
    named = dict(model=NAME, messages=ask, tools=[WEATHER_TOOL], max_tokens=40, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plain = client.chat.completions.create(**named).choices[0].message.tool_calls
    jsonschema.validate(json.loads(plain[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed = "".join(tc.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **named)
                       for ch in chunk.choices for tc in ch.delta.tool_calls or [] if tc.function)
    assert json.loads(streamed) == json.loads(plain[0].function.arguments)
    assert_no_leaks(app, APP, {"colocated"})


def test_the_openai_agents_sdk_runs_a_tool_using_agent_to_a_final_answer(app):
    """A real agent client: the first turn must call the tool, the SDK then sends tool_choice
    "auto" with the tool's result (what needs auto tool choice on), and the run ends in an
    answer rather than in the SDK's turn limit."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        asked.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    client = AsyncOpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the weather the tool reports.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=NAME, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert asked and all(isinstance(c, str) and c for c in asked), asked
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    assert_no_leaks(app, APP, {"colocated"})


def test_langchain_bind_tools_with_a_named_tool_choice_returns_a_valid_call(app):
    """langchain-openai's ChatOpenAI: `bind_tools([tool], tool_choice=NAME)` sends the named
    choice; the call that comes back fits the schema LangChain made from the tool, well within
    the token budget (finish_reason "stop", as OpenAI ends a forced named call, not "length")."""
    import jsonschema
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=NAME, base_url=f"{app}/v1", api_key="unused", max_retries=0, temperature=0,
                     max_tokens=64)
    answer = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert answer.response_metadata["finish_reason"] == "stop", answer
    assert [c["name"] for c in answer.tool_calls] == ["get_weather"] and not answer.invalid_tool_calls
    jsonschema.validate(answer.tool_calls[0]["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    assert answer.usage_metadata["output_tokens"] <= 64
    assert_no_leaks(app, APP, {"colocated"})
