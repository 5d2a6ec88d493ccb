"""StructuredOutputManager's backend life cycle: built in the background when the engine
starts, once, reused by every compile; a failed build is retried by the first request."""

from __future__ import annotations

import threading

from engine import LLM
from engine.structured_output import StructuredOutputsParams
from engine.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from engine.structured_output.manager import StructuredOutputManager

REGEX = StructuredOutputsParams(regex="a+")


class _Grammar(StructuredOutputGrammar):
    def accept_tokens(self, tokens): return True
    def fill_bitmask(self, bitmask, index): bitmask[index] = -1
    def copy(self): return _Grammar()

    @property
    def error(self): return ""


class _Backend(StructuredOutputBackend):
    name = "fake"

    @staticmethod
    def validate(params): ...
    def compile(self, params): return _Grammar()


class _Factory:
    """Counts builds and the threads they ran on; fails the first `failures` builds."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.threads: list[str] = []

    def __call__(self) -> StructuredOutputBackend:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) <= self.failures:
            raise RuntimeError("no tokenizer today")
        return _Backend(None, 64, [0])


def _manager(factory) -> StructuredOutputManager:
    return StructuredOutputManager(factory, vocab_size=64, max_num_seqs=4)


def test_prebuild_builds_once_off_the_calling_thread_and_compiles_reuse_it():
    factory = _Factory()
    manager = _manager(factory)
    manager.prebuild().result(timeout=30)
    assert manager.backend_ready
    so_request = manager.grammar_init(REGEX, [])
    so_request.grammar_future.result(timeout=30)
    assert so_request.grammar is not None and so_request.compile_error is None
    assert len(factory.threads) == 1 and factory.threads[0].startswith("pdserve-grammar")
    manager.shutdown()


def test_failed_prebuild_is_retried_by_the_first_request():
    factory = _Factory(failures=1)
    manager = _manager(factory)
    manager.prebuild().result(timeout=30)  # the failure is logged, not raised
    assert not manager.backend_ready
    so_request = manager.grammar_init(REGEX, [])
    so_request.grammar_future.result(timeout=30)
    assert manager.backend_ready and len(factory.threads) == 2


def test_backend_that_cannot_be_built_fails_the_request_with_the_reason():
    manager = _manager(_Factory(failures=2))
    manager.prebuild().result(timeout=30)
    so_request = manager.grammar_init(REGEX, [])
    so_request.grammar_future.exception(timeout=30)
    assert so_request.grammar is None and "no tokenizer today" in so_request.compile_error


def test_engine_start_builds_the_backend_before_any_structured_request(tiny_model):
    llm = LLM(tiny_model, max_model_len=64, num_kv_blocks=8)
    core = llm.engine.core
    core.structured_output_backend_built.result(timeout=60)
    assert core.structured_output_manager.backend_ready
    core.shutdown()
