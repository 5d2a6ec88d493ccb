"""The front end gives its engine core its tokenizer (engine.tokenizer.pickled_tokenizer,
EngineCore.give_tokenizer): the core builds its structured-output backend from that copy
instead of loading the tokenizer again (1.7-2.4 CPU-s of transformers imports in a fresh core
process). Shown on a model directory without tokenizer files, whose front end reads them from
elsewhere: a core that loaded its own could build no backend, and its structured request
would fail."""

from __future__ import annotations

import os
import re
import shutil

import pytest

import engine.llm_engine as llm_engine
from engine import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from engine.core import EngineCore
from engine.tokenizer import load_tokenizer, pickled_tokenizer

REGEX = r"[a-c]{3}-[0-9]{2}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PARAMS = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX))


@pytest.fixture
def no_tokenizer_files(tiny_model, tmp_path, monkeypatch) -> str:
    """A copy of the tiny model without its tokenizer files; only the front end's
    load_tokenizer finds them (in the original directory)."""
    copy = str(shutil.copytree(tiny_model, tmp_path / "model"))
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(copy, name)):
            os.remove(os.path.join(copy, name))
    monkeypatch.setattr(llm_engine, "load_tokenizer", lambda model_dir: load_tokenizer(tiny_model))
    return copy


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_the_core_builds_its_grammar_backend_from_the_front_ends_tokenizer(no_tokenizer_files, core_process):
    llm = LLM(no_tokenizer_files, max_model_len=64, num_kv_blocks=16, engine_core_process=core_process)
    try:
        core = llm.engine.core
        if not core_process:
            core.structured_output_backend_built.result(timeout=60)
            assert core.structured_output_manager.backend_ready
        [out] = llm.generate(["The code is"], PARAMS, use_tqdm=False)
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0]
    finally:
        llm.engine.core.shutdown()


def test_without_the_hand_off_the_same_request_finds_no_tokenizer(no_tokenizer_files, monkeypatch):
    """The check above can fail: a core left to load its own tokenizer has no backend."""
    monkeypatch.setattr(llm_engine, "pickled_tokenizer", lambda tokenizer: None)
    llm = LLM(no_tokenizer_files, max_model_len=64, num_kv_blocks=16)
    try:
        [out] = llm.generate(["The code is"], PARAMS, use_tqdm=False)
        assert out.outputs[0].finish_reason == "error" and "tokenizer" in out.outputs[0].stop_reason, out.outputs[0]
    finally:
        llm.engine.core.shutdown()


def test_a_copy_that_does_not_unpickle_is_loaded_again(tiny_model):
    core = EngineCore(EngineArgs(model=tiny_model, max_model_len=64, num_kv_blocks=16).create_engine_config(),
                      tokenizer_from_front_end=True)
    try:
        assert core.structured_output_backend_built is None  # waits for its front end
        core.give_tokenizer(b"not a pickle")
        core.structured_output_backend_built.result(timeout=60)
        assert core.structured_output_manager.backend_ready
    finally:
        core.shutdown()


def test_a_tokenizer_that_does_not_pickle_is_none():
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("no")

    assert pickled_tokenizer(Unpicklable()) is None


def test_a_front_end_that_fails_to_start_stops_its_core_process(tiny_model, monkeypatch):
    made = []

    def make(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    def no_tokenizer(model_dir):
        raise OSError("no tokenizer here")

    real = llm_engine.make_core_client
    monkeypatch.setattr(llm_engine, "make_core_client", make)
    monkeypatch.setattr(llm_engine, "load_tokenizer", no_tokenizer)
    with pytest.raises(OSError, match="no tokenizer here"):
        LLM(tiny_model, max_model_len=64, num_kv_blocks=16, engine_core_process=True)
    [client] = made
    assert not client.process.proc.is_alive()
