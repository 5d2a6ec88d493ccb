"""How one request is split into a prefill request and a decode request.

The prefill replica runs the prompt with max_tokens=1: it samples the first token and exports
the prompt's KV. The decode replica continues from prompt + [first token] with the prompt's
KV loaded and its own budget reduced by the token already produced, so the concatenated
tokens are those a colocated engine would produce.
"""

from __future__ import annotations

import dataclasses

from engine.kv_transfer_params import KVTransferParams
from engine.sampling_params import SamplingParams


def prefill_kv_params(params: SamplingParams, transfer_id: str | None = None) -> KVTransferParams:
    """The prefill half exports the prompt's KV (under `transfer_id` when the requester names
    it), and, when decode will continue the text, leaves a character split at the first token
    and a possible stop-string prefix to decode instead of emitting them here."""
    return KVTransferParams(do_remote_decode=True, transfer_id=transfer_id,
                            output_continues=params.max_tokens is None or params.max_tokens > 1)


def decode_kv_params(exported: KVTransferParams) -> KVTransferParams:
    """The decode half loads the exported prompt KV; its prompt ends with the one token the
    prefill generated."""
    return dataclasses.replace(exported, num_prior_output_tokens=1)


def prefill_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def needs_decode(first_finish_reason: str | None, params: SamplingParams) -> bool:
    """Whether anything is left after the prefill's single token. The prefill always stops at
    max_tokens=1 ("length"); it is the real end only if the user asked for one token."""
    if first_finish_reason != "length":
        return False  # EOS, stop token/string, error, abort
    return params.max_tokens is None or params.max_tokens > 1


def decode_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(
        params,
        max_tokens=None if params.max_tokens is None else params.max_tokens - 1,
        min_tokens=max(params.min_tokens - 1, 0),
    )


def decode_prompt(prompt_token_ids: list[int], first_token: int, mm_features=None) -> dict:
    """The decode request's prompt. With images it carries their placeholders and hashes
    (MultiModalFeatures without pixels): decode never encodes, it loads the prompt's KV, but
    it hashes its blocks by image as the prefill did."""
    prompt = {"prompt_token_ids": list(prompt_token_ids) + [first_token]}
    if mm_features is not None:
        prompt["multi_modal_features"] = mm_features
    return prompt
