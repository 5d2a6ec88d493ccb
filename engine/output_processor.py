"""Turns EngineCoreOutputs into RequestOutputs: text deltas, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.multimodal.features import MultiModalFeatures
from engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from engine.request import Request
from engine.sched.output import EngineCoreOutput


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    sent_chars: int = 0  # how much of `text` streaming has handed out
    mm_features: MultiModalFeatures | None = None  # without pixels, for the RequestOutputs
    prompt_logprobs: PromptLogprobs | None = None  # from the first output on


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        detokenizer, prior_text = _detokenizer(self.tokenizer, request)
        # Text of prior output tokens (P/D: the prefill's first token) takes part in stop-string
        # matching; the part the other engine held back (a possible stop-string prefix) is
        # still to be sent from here, by the same rule it used.
        self.states[request.request_id] = _RequestState(
            request=request,
            prompt=prompt,
            detokenizer=detokenizer,
            text=prior_text,
            sent_chars=max(len(prior_text) - _stop_hold(params), 0),
            logprobs=[] if params.logprobs is not None else None,
            mm_features=None if request.mm_features is None else request.mm_features.without_pixels(),
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the request outputs and the ids the core must finish because a stop
        string matched."""
        outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for co in core_outputs:
            state = self.states.get(co.request_id)
            if state is None:
                continue
            params = state.request.sampling_params
            if co.prompt_logprobs is not None:
                state.prompt_logprobs = _with_text(self.tokenizer, co.prompt_logprobs)
            finish_reason, stop_reason = co.finish_reason, co.stop_reason
            new_ids: list[int] = []
            for i, tok in enumerate(co.new_token_ids):
                new_ids.append(tok)
                if state.logprobs is not None and co.new_logprobs:
                    state.logprobs.append(co.new_logprobs[i])
                delta = state.detokenizer.step(tok)
                state.text += delta
                if params.stop and delta:
                    hit = find_stop_string(state.text, len(delta), params.stop)
                    if hit is not None:
                        stop, idx = hit
                        state.text = state.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
                        finish_reason, stop_reason = "stop", stop
                        if not co.finished:
                            stopped_by_string.append(co.request_id)
                        break
            first = not state.token_ids
            state.token_ids.extend(new_ids)
            finished = finish_reason is not None
            if finished and _flushes(state.request, finish_reason, stop_reason):
                state.text += state.detokenizer.flush()
            # While a stop string could still be completing (here, or on the engine the text
            # continues on), hold its possible prefix back.
            hold = 0 if finished and not _continues(state.request, finish_reason) else _stop_hold(params)
            visible = max(len(state.text) - hold, state.sent_chars)
            delta_text = state.text[state.sent_chars : visible]
            state.sent_chars = visible
            outputs.append(
                RequestOutput(
                    request_id=co.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.request.prompt_token_ids,
                    multi_modal_features=state.mm_features,
                    outputs=[
                        CompletionOutput(
                            index=0,
                            text=state.text,
                            token_ids=state.token_ids,
                            finish_reason=finish_reason,
                            stop_reason=stop_reason,
                            logprobs=state.logprobs,
                        )
                    ],
                    finished=finished,
                    num_cached_tokens=co.num_cached_tokens,
                    delta_text=delta_text,
                    delta_token_ids=new_ids,
                    delta_logprobs=co.new_logprobs[: len(new_ids)] if co.new_logprobs else None,
                    kv_transfer_params=co.kv_transfer_params,
                    # Only the first output carries it (the queue time is known by then).
                    metrics=_metrics(state.request) if first else {},
                    prompt_logprobs=state.prompt_logprobs,
                    pooled=co.pooled,
                )
            )
            if finished:
                del self.states[co.request_id]
        return outputs, stopped_by_string


def _detokenizer(tokenizer, request: Request) -> tuple[IncrementalDetokenizer, str]:
    """A detokenizer positioned as if the request's prior output tokens had been streamed by
    it, and the text they decoded to (less a multi-byte character still pending)."""
    k = request.kv_transfer_params.num_prior_output_tokens if request.kv_transfer_params else 0
    ids = request.prompt_token_ids
    detok = IncrementalDetokenizer(tokenizer, ids[: len(ids) - k], request.sampling_params.skip_special_tokens)
    text = "".join(detok.step(token) for token in ids[len(ids) - k:])
    return detok, text


def _with_text(tokenizer, entries: PromptLogprobs) -> PromptLogprobs:
    """The entries with each token's text (vLLM's decoded_token), decoded once per distinct id."""
    ids = sorted({t for e in entries if e for t in e})
    text = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids]))) if ids else {}
    return [None if e is None else {t: Logprob(lp.logprob, lp.rank, text[t]) for t, lp in e.items()}
            for e in entries]


def _stop_hold(params) -> int:
    return max(len(s) for s in params.stop) - 1 if params.stop else 0


def _continues(request: Request, finish_reason: str | None) -> bool:
    """The output goes on on another engine (a P/D prefill stopped at its one token)."""
    kv = request.kv_transfer_params
    return finish_reason == "length" and kv is not None and kv.output_continues


def _flushes(request: Request, finish_reason: str, stop_reason) -> bool:
    """Whether held-back text is emitted at the end: not after a stop string (the text was
    cut there), nor when the output continues on another engine."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return False
    return not _continues(request, finish_reason)


def _metrics(request) -> dict:
    if request.first_scheduled_time is None:
        return {}
    return {"queue_time_s": request.first_scheduled_time - request.arrival_time}
