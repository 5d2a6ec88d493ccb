"""The front end gives its engine core its tokenizer (engine.tokenizer.pickled_tokenizer,
EngineCore.give_tokenizer): the core builds its structured-output backend from that copy
instead of loading the tokenizer again (1.7-2.4 CPU-s of transformers imports in a fresh core
process). Shown by taking the tokenizer files away once the front end has read them: a core
that loaded its own could then build no backend, and its structured request would fail."""

from __future__ import annotations

import os
import re
import shutil

import pytest

import engine.llm_engine as llm_engine
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.tokenizer import load_tokenizer, pickled_tokenizer

REGEX = r"[a-c]{3}-[0-9]{2}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> str:
    return shutil.copytree(tiny_model, tmp_path / "model")


@pytest.fixture
def files_gone_after_the_front_end_loads(monkeypatch):
    """The front end's load_tokenizer, after which the tokenizer files are gone."""
    def load_then_remove(model_dir: str):
        tokenizer = load_tokenizer(model_dir)
        for name in TOKENIZER_FILES:
            path = os.path.join(model_dir, name)
            if os.path.exists(path):
                os.remove(path)
        return tokenizer

    monkeypatch.setattr(llm_engine, "load_tokenizer", load_then_remove)


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_the_core_builds_its_grammar_backend_from_the_front_ends_tokenizer(
        model_copy, files_gone_after_the_front_end_loads, core_process):
    llm = LLM(str(model_copy), max_model_len=64, num_kv_blocks=16, engine_core_process=core_process)
    try:
        assert not os.path.exists(os.path.join(model_copy, "tokenizer.json"))
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX))
        [out] = llm.generate(["The code is"], params, use_tqdm=False)
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0]
    finally:
        llm.engine.core.shutdown()


def test_a_core_that_loads_its_own_tokenizer_fails_the_same_request(model_copy, files_gone_after_the_front_end_loads,
                                                                   monkeypatch):
    """The check above can fail: without the hand-off the same request has no backend."""
    monkeypatch.setattr(llm_engine, "pickled_tokenizer", lambda tokenizer: None)
    llm = LLM(str(model_copy), max_model_len=64, num_kv_blocks=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX))
        [out] = llm.generate(["The code is"], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "error" and "tokenizer" in out.outputs[0].stop_reason, out.outputs[0]
    finally:
        llm.engine.core.shutdown()


def test_a_tokenizer_that_does_not_pickle_is_none():
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("no")

    assert pickled_tokenizer(Unpicklable()) is None
