"""cluster.http.front_end.FrontEnd: a route's prompt is checked and completed by the engine's own
input processor, so the ingress and the engine cannot disagree on a prompt or on max_tokens."""

from __future__ import annotations

import pytest

from cluster.http import openai_format as fmt
from cluster.http.errors import OpenAIError
from cluster.http.front_end import FrontEnd
from engine import EngineArgs
from engine.errors import ParameterError
from engine.llm_engine import front_end
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def front(tiny_model) -> FrontEnd:
    tokenizer, processor = front_end(EngineArgs(tiny_model, max_model_len=64).create_engine_config())
    return FrontEnd("tiny", tiny_model, tokenizer, processor, fmt.TokenText(tokenizer))


def test_an_unset_max_tokens_becomes_the_engines_own_default(front):
    unset = SamplingParams(max_tokens=None)  # an OpenAI body without max_tokens
    ids, params = front.prepare([5, 6, 7], unset)
    request, _ = front.processor.process({"prompt_token_ids": ids}, unset)
    assert params.max_tokens == request.max_tokens == 64 - 3  # the room left in the context
    assert front.prepare([5, 6, 7], SamplingParams(max_tokens=9))[1].max_tokens == 9  # a given one is kept


def test_a_prompt_the_engine_would_refuse_is_refused_here_naming_its_field(front):
    with pytest.raises(ParameterError) as e:
        front.prepare([5] * 64, SamplingParams(max_tokens=None))
    assert e.value.field == "prompt"
    with pytest.raises(ParameterError) as e:
        front.prepare([5, 6], SamplingParams(max_tokens=63))
    assert e.value.field == "max_tokens" and "<= 62" in str(e.value)


def test_another_models_name_is_a_404(front):
    front.check_model("tiny")
    with pytest.raises(OpenAIError) as e:
        front.check_model("gpt-4")
    assert e.value.status == 404 and e.value.param == "model"
