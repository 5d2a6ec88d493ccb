"""The scheduler's share of speculative decoding: which drafts a request verifies this step,
and how many lookahead KV slots a draft model needs past its scheduled tokens."""

from __future__ import annotations

from engine.request import Request


def lookahead_slots(request: Request, n: int, num_computed: int, num_lookahead: int, max_model_len: int) -> int:
    """Slots reserved past `request`'s n scheduled tokens, where a draft model writes the KV of
    the drafts it decodes after the step; never past max_model_len. None for a request under
    a grammar (it does not speculate) or without a draft model (n-gram keeps no KV)."""
    if not num_lookahead or request.structured_output_request is not None:
        return 0
    return max(min(num_lookahead, max_model_len - num_computed - n), 0)


def drafts_to_verify(request: Request, n: int, budget: int, max_model_len: int) -> list[int]:
    """The request's drafts that fit this step (taken off the request): only in decode (one
    token to compute), within the token budget, and never past its last possible token
    (max_tokens, max_model_len), so the lookahead never reaches beyond what it may produce."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    if not drafts or n != 1 or request.structured_output_request is not None:
        return []
    room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1)
    return drafts[:max(room, 0)]
