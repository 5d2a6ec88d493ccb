"""Decode migration: a request whose engine died or hung goes on on another engine replica
(docs/pd.md#decode-migration; NVIDIA Dynamo's `--migration-limit`).

The continuation is the request itself with the tokens already produced appended to its
prompt, marked as prior output (`KVTransferParams.num_prior_output_tokens`, as a P/D decode
half is): the engine that takes it recomputes (or finds in a KV tier) their KV, counts them
against `max_tokens` and `min_tokens`, advances a seeded request's random stream past them,
replays them through its grammar, and its detokenizer resumes where the client's text ends.
`Migration` keeps what the client was sent and joins the continuation's outputs onto it, so
the stream goes on with no duplicate and no gap, and `usage` and logprobs stay whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from cluster.replica.caller_watch import watch_handle, while_caller_lives
from cluster.replica.errors import ReplicaError
from engine.engine_request import EngineRequest
from engine.errors import EngineDeadError, ParameterError
from engine.kv_transfer_params import KVTransferParams
from engine.outputs import CompletionOutput, RequestOutput

DEFAULT_MIGRATION_LIMIT = 3  # Dynamo's default
MAX_MIGRATION_LIMIT = 100
# Why a request migrated (the `reason` of pdserve:request_migrations_total): an engine replica
# it was running on by a call (routed engines, or the replica it had migrated to) failed or
# became unreachable; the ingress's own engine died (a core process or a rank gone); an engine
# hung (the step watchdog failed it, docs/operations.md#engine-hang-watchdog).
MIGRATION_REASONS = ("replica_died", "engine_died", "engine_hung")
# The step watchdog's message names its bound (engine.core_client.watchdog).
_HUNG_MARK = "engine_step_timeout_s"

Resume = Callable[[EngineRequest], AsyncIterator[RequestOutput]]


def check_migration_limit(limit: object) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= MAX_MIGRATION_LIMIT:
        raise ParameterError("migration_limit", f"migration_limit must be an integer in [0, {MAX_MIGRATION_LIMIT}] "
                             f"(0: a request whose engine fails is not migrated), got {limit!r}")


def migration_reason(error: BaseException) -> str | None:
    """Why `error` lets its request go on elsewhere, or None when it does not: only a failure of
    the engine that ran it (never the request's own fault, a refused KV load, a failed prefill)."""
    if isinstance(error, EngineDeadError):
        return "engine_hung" if _HUNG_MARK in str(error) else "engine_died"
    if isinstance(error, ReplicaError) and error.replica_died:
        return "engine_hung" if _HUNG_MARK in str(error) else "replica_died"
    return None


class Migration:
    """One request's record across the engines it runs on: `seen` each output the client
    gets; after a failure `continuation()` is the request that goes on elsewhere, and
    `resumed` turns its outputs into the original request's."""

    def __init__(self, request: EngineRequest, limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.request, self.limit = request, limit
        self.count = 0  # migrations so far
        self._last: RequestOutput | None = None
        self._n = 0  # tokens the client has
        self._texts: list[str] = []  # every delta_text the client got, in order

    def seen(self, out: RequestOutput) -> None:
        # No copy per output: the engine's cumulative lists grow in place, and the length
        # taken here says how much of them the client has.
        self._last = out
        self._n = len(out.outputs[0].token_ids)
        if out.delta_text:
            self._texts.append(out.delta_text)

    def allows(self) -> bool:
        """Another migration is allowed: within the limit, and the request has not finished
        (an error after its last output leaves nothing to go on with)."""
        return self.count < self.limit and not (self._last is not None and self._last.finished)

    def continuation(self) -> EngineRequest:
        """The request that goes on from what the client has (counted as one migration)."""
        self.count += 1
        request = self.request
        request_id = f"{request.request_id}-m{self.count}"  # never an id its new engine holds
        done = [] if self._last is None else list(self._last.outputs[0].token_ids[: self._n])
        if not done:  # nothing produced yet: the request as it came, run whole
            return dataclasses.replace(request, request_id=request_id, kv_transfer_params=None)
        params = request.sampling_params
        return dataclasses.replace(
            request, request_id=request_id, prompt_token_ids=list(request.prompt_token_ids) + done,
            sampling_params=dataclasses.replace(
                params, max_tokens=params.max_tokens - len(done), min_tokens=max(params.min_tokens - len(done), 0),
                prompt_logprobs=None),  # the client has them
            kv_transfer_params=KVTransferParams(num_prior_output_tokens=len(done)),
        )

    async def resumed(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The continuation's `outputs` as the original request's: cumulative from its start,
        with the continuation's own deltas. Closing it closes `outputs` (which aborts the
        continuation on its engine)."""
        last, request = self._last, self.request
        base = last.outputs[0] if last is not None else None
        # Grown in place and handed out as they are, as the engine's own outputs do.
        token_ids = list(base.token_ids[: self._n]) if base is not None else []
        logprobs = (list(base.logprobs[: self._n]) if base is not None and base.logprobs is not None
                    else [] if request.sampling_params.logprobs is not None else None)
        text = "".join(self._texts)
        try:
            async for out in outputs:
                c = out.outputs[0]
                token_ids += out.delta_token_ids
                text += out.delta_text
                if logprobs is not None and out.delta_logprobs:
                    logprobs += out.delta_logprobs
                yield RequestOutput(
                    request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
                    outputs=[CompletionOutput(0, text, token_ids, c.finish_reason, c.stop_reason, logprobs)],
                    finished=out.finished,
                    num_cached_tokens=out.num_cached_tokens if last is None else last.num_cached_tokens,
                    delta_text=out.delta_text, delta_token_ids=list(out.delta_token_ids),
                    delta_logprobs=out.delta_logprobs,
                    # The first engine's queue time was counted; the prompt's logprobs are its.
                    metrics=out.metrics if last is None else {},
                    prompt_logprobs=out.prompt_logprobs if last is None else last.prompt_logprobs,
                    multi_modal_features=out.multi_modal_features if last is None else last.multi_modal_features,
                )
        finally:
            await outputs.aclose()


class MigrationRefused(ReplicaError):
    """A replica that cannot take a migrated request: the one it left (Serve's router may pick
    it again), or one whose own engine failed too."""


# How often a migrated request is routed again while every replica that could take it
# refuses (their engines failed too, or this is the only one): 0.1 s apart, doubling to 4 s,
# about 42 s in all, which covers Serve starting a replacement for a replica whose engine died
# (measured 22-23 s on a busy 2-core machine, the default model); then the client gets its
# 503. The client sees a pause, not an error.
RESUME_TRIES = 15


class ReplicaResume:
    """Where a direct-streaming ingress sends a request its own engine failed: another ingress
    replica's engine, by a streaming call through `handle` (this deployment's own). A replica
    that refuses it (its own engine failed, or it is this one, `own_id`) is passed over: the
    call is routed again, at most `tries` times, before the client gets its 503. The router
    never picks this replica while another is there (cluster.http.ingress_router)."""

    def __init__(self, handle, own_id: str, tries: int = RESUME_TRIES, backoff_s: float = 0.1,
                 max_backoff_s: float = 4.0) -> None:
        self.handle, self.own_id = handle.options(stream=True), own_id
        self.tries, self.backoff_s, self.max_backoff_s = tries, backoff_s, max_backoff_s
        self.caller = watch_handle(handle)  # so the replica running it ends it if this one dies

    async def __call__(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        for attempt in range(self.tries):
            # By keyword: the ingress's router passes over `avoid` (cluster.http.ingress_router).
            stream = self.handle.resume.remote(request, avoid=self.own_id, caller=self.caller)
            try:
                first = await stream.__anext__()
                break
            except StopAsyncIteration:
                return
            except Exception as e:  # nothing ran there: route it again, after a pause that grows
                stream.cancel()
                if attempt == self.tries - 1:
                    raise MigrationRefused(f"{type(e).__name__}: {e}") from e
                # Serve's router sees the replica state change; a replacement starts.
                await asyncio.sleep(min(self.backoff_s * 2 ** attempt, self.max_backoff_s))
            except BaseException:  # left while it was being placed (the client went away)
                stream.cancel()
                raise
        try:
            yield first
            async for out in stream:
                yield out
        except Exception as e:
            # That replica failed in turn: the request may go on once more, within the limit.
            raise ReplicaError(f"the replica the request migrated to failed: {type(e).__name__}: {e}",
                               replica_died=True) from e
        finally:
            stream.cancel()  # left early (client gone): aborted on that replica's engine


async def resume_here(engine, request: EngineRequest, avoid: str, own_id: str,
                      caller=None) -> AsyncIterator[RequestOutput]:
    """The body of an ingress replica's `resume` call: the migrated request on this replica's
    own `engine` (None: none here), sent back as deltas (the caller keeps the cumulative state,
    so no message grows with the prompt or the output); aborted there once `caller` (the
    calling replica's actor handle, when it sent one) died (cluster.replica.caller_watch)."""
    if engine is None or avoid == own_id:
        raise MigrationRefused(f"replica {own_id} cannot take a request migrated from {avoid}")
    try:
        await engine.check_health()
    except Exception as e:
        raise MigrationRefused(f"replica {own_id}'s engine failed: {e}") from e
    async for out in while_caller_lives(engine.generate(request), caller):
        c = out.outputs[0]
        yield dataclasses.replace(out, prompt_token_ids=[], prompt=None,
                                  outputs=[CompletionOutput(0, "", [], c.finish_reason, c.stop_reason, None)])
