"""How one request becomes a prefill request and a decode request.

The prefill half runs the prompt with max_tokens=1: it samples the first token and exports the
prompt's KV. The decode half continues from prompt + [first token] with the prompt's KV
loaded and its budget reduced by the token already produced, so the concatenated tokens are
those one colocated engine would produce (docs/pd.md). Both halves are the ingress's
EngineRequest with other params: nothing is tokenized again.
"""

from __future__ import annotations

import dataclasses

from engine.engine_request import EngineRequest
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import RequestOutput


def prefill_request(request: EngineRequest, transfer_id: str | None = None) -> EngineRequest:
    """The prefill half: one token, its prompt's KV exported (under `transfer_id` when the
    requester names it). When decode will continue the text, a character split at the first
    token and a possible stop-string prefix are left to decode instead of emitted here."""
    params = request.sampling_params
    return dataclasses.replace(
        request,
        sampling_params=dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
        kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=transfer_id,
                                            output_continues=params.max_tokens > 1),
    )


def needs_decode(first_finish_reason: str | None, request: EngineRequest) -> bool:
    """Whether anything is left after the prefill's single token. The prefill always stops at
    max_tokens=1 ("length"); it is the real end only if the user asked for one token."""
    if first_finish_reason != "length":
        return False  # EOS, stop token/string, error, abort
    return request.sampling_params.max_tokens > 1


def decode_request(request: EngineRequest, first: RequestOutput) -> EngineRequest:
    """The decode half, after the prefill's output `first`: the prompt ends with the one token
    the prefill generated, and loads the KV it exported (none: the decode engine computes the
    prompt, with the same answer). Images keep their placeholders and hashes but not their
    pixels: decode never encodes, it hashes its blocks by image as the prefill did."""
    params = request.sampling_params
    exported = first.kv_transfer_params or KVTransferParams()
    features = request.mm_features
    return dataclasses.replace(
        request,
        prompt_token_ids=list(request.prompt_token_ids) + [first.outputs[0].token_ids[0]],
        sampling_params=dataclasses.replace(
            params, max_tokens=params.max_tokens - 1, min_tokens=max(params.min_tokens - 1, 0),
            prompt_logprobs=None,  # the prefill side computed them; decode loads the prompt's KV
        ),
        mm_features=None if features is None else features.without_pixels(),
        kv_transfer_params=dataclasses.replace(exported, num_prior_output_tokens=1),
    )
