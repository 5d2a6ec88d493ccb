"""StructuredOutputManager: compiles grammars off the engine thread (cached by spec) and fills
the batch bitmask the sampler applies. Lives beside the scheduler, in the engine process."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from engine.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    bitmask_words,
)
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.request import StructuredOutputRequest, split_after

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 256
_COMPILE_THREADS = 2


class StructuredOutputManager:
    """`backend_factory()` builds the backend (loading the tokenizer): on a compile thread
    when the engine starts (`prebuild`), else on the first structured request, which then
    waits for it."""

    def __init__(self, backend_factory: Callable[[], StructuredOutputBackend], vocab_size: int,
                 max_num_seqs: int) -> None:
        self._backend_factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pdserve-grammar")
        # cache_key -> compiled template at the grammar's start (copied per request).
        self._templates: OrderedDict[tuple[str, str], StructuredOutputGrammar] = OrderedDict()
        self._templates_lock = threading.Lock()
        # One preallocated [max_num_seqs, words] int32 mask; each step fills its first rows.
        self._bitmask = np.empty((max_num_seqs, bitmask_words(vocab_size)), dtype=np.int32)

    # ---- compile (pool threads) ---------------------------------------------------------
    def _get_backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def prebuild(self) -> Future:
        """Start building the backend now, in the background, so the first structured request
        does not wait for it (~1 s on SmolLM2-135M: its tokenizer loaded again and indexed by
        llguidance; ~0.02 s on a 1k-token vocab). Costs an engine that never sees one that
        much CPU on one compile thread, after start-up, and the index's memory. Returns the
        build's future (done once the backend is built or failed to)."""
        return self._pool.submit(self._prebuild)

    @property
    def backend_ready(self) -> bool:
        return self._backend is not None

    def _prebuild(self) -> None:
        try:
            self._get_backend()
        except Exception:
            # Not fatal here: the first structured request builds it again and fails with
            # the error, as a request.
            logger.warning("building the structured-output backend failed", exc_info=True)

    def _template(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        key = params.cache_key
        with self._templates_lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        template = self._get_backend().compile(params)  # outside the lock: compiles overlap
        with self._templates_lock:
            self._templates[key] = template
            if len(self._templates) > _MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def _create_grammar(self, params: StructuredOutputsParams, prior_tokens: list[int]) -> StructuredOutputGrammar:
        grammar = self._template(params).copy()
        if prior_tokens and not grammar.accept_tokens(prior_tokens):
            raise ValueError(f"tokens sampled before this engine do not match the grammar: {grammar.error}")
        return grammar

    # ---- engine thread ------------------------------------------------------------------
    def grammar_init(self, params: StructuredOutputsParams, prior_tokens: list[int]) -> StructuredOutputRequest:
        """Start compiling a request's matcher; `prior_tokens` are output tokens it already
        has (sampled by another engine), replayed into the matcher."""
        before_start, grammar_tokens = split_after(list(prior_tokens), params.after_tokens)
        future: Future = self._pool.submit(self._create_grammar, params, grammar_tokens)
        tail = list(prior_tokens)[-len(params.after_tokens):] if before_start else []
        return StructuredOutputRequest(params, future, before_start, tail)

    def grammar_bitmask(self, requests: list, num_scheduled: dict[str, int]) -> tuple[dict[str, int], np.ndarray | None]:
        """({req_id: row}, [rows, words] int32) for the structured requests among the
        scheduled `requests` that sample this step; row i holds the tokens allowed next.

        NOTE: a prefill chunk that stops short of the prompt's end samples nothing, so it gets
        no row (its matcher has not reached its first output token)."""
        row_of: dict[str, int] = {}
        grammars: list[tuple[StructuredOutputGrammar, int]] = []
        for r in requests:
            so_request = r.structured_output_request
            if so_request is None or r.num_computed_tokens + num_scheduled[r.request_id] < r.num_tokens:
                continue
            if so_request.before_start:
                continue  # its constraint has not started: any token
            row_of[r.request_id] = len(grammars)
            grammars.append((so_request.grammar, len(grammars)))
        if not grammars:
            return row_of, None
        n = len(grammars)
        self._get_backend().fill_bitmasks(grammars, self._bitmask[:n])
        # A copy: the scheduler output may outlive this step (and cross to other workers).
        return row_of, self._bitmask[:n].copy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
