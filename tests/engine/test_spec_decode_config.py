"""speculative_config is validated where it enters, with errors naming the field, and
reaches the engine from every entry point (LLM kwargs, the CLI flag)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from engine import LLM
from engine.args import EngineArgs
from engine.errors import ParameterError
from engine.spec_decode import NgramProposer, SpeculativeConfig


@pytest.mark.parametrize("value, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "speculative_config.num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "lookahead": 3}, "speculative_config.lookahead"),
    ({"method": "draft_model", "model": "/no/such/dir", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ("{not json", "speculative_config"),
    ([3], "speculative_config"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ParameterError) as e:
        EngineArgs(model="m", speculative_config=value).create_engine_config()
    assert e.value.field == field
    assert field.split(".")[-1] in str(e.value)


def test_draft_model_with_another_vocabulary_is_refused(model_factory):
    target = model_factory("llama")
    draft = model_factory("llama", preset="small")  # a 2048-token vocabulary
    with pytest.raises(ParameterError, match="vocabulary") as e:
        LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    assert e.value.field == "speculative_config.model"


def test_cli_flag_takes_a_json_object():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = EngineArgs.from_cli_args(ns, model="m").create_engine_config()
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert EngineArgs(model="m").create_engine_config().speculative is None


def test_cli_flag_refuses_what_is_not_a_json_object(capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "ngram"])
    assert "speculative-config" in capsys.readouterr().err


def test_one_lookup_bound_sets_the_other():
    c = SpeculativeConfig.from_user({"method": "ngram", "prompt_lookup_max": 1})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 1)
    c = SpeculativeConfig.from_user({"method": "ngram", "prompt_lookup_min": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # Suffix [2, 3] occurs at 1 (then 4, 5, 6) and at 6 (then 9, 2, 3): the later one wins.
    assert p.propose(np.array([1, 2, 3, 4, 5, 6, 2, 3, 9, 2, 3])) == [9, 2, 3]
    # Longest first: [7, 2, 3] beats the more recent [2, 3].
    assert p.propose(np.array([7, 2, 3, 8, 8, 2, 3, 5, 7, 2, 3])) == [8, 8, 2]
    assert p.propose(np.array([1, 2, 3, 4, 1, 2]), max_drafts=1) == [3]
    assert p.propose(np.array([1, 2, 3, 4, 5])) == []


def test_ngram_respects_the_minimum_length():
    p = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=4)
    assert p.propose(np.array([5, 1, 9, 8, 1])) == []  # only a 1-gram matches
    assert p.propose(np.array([5, 1, 9, 8, 5, 1])) == [9, 8]
    # Near the start the continuation is cut where the tokens end.
    assert p.propose(np.array([4, 4, 4])) == [4]
