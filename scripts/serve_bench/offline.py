"""The offline engine on the serving benchmark's requests, in this process: its CPU time per
output token (the baseline of bench_server_cpu.py), and the size of the per-step messages an
engine replica would send its ingress for the same steps."""

from __future__ import annotations

import pickle
import time
from collections import deque
from dataclasses import dataclass

from cluster.pd.split import decode_request, needs_decode, prefill_request
from engine.sampling_params import SamplingParams


@dataclass
class OfflineRun:
    concurrency: int
    requests: int
    output_tokens: int
    cpu_s: float  # process CPU time (every thread) over the run
    wall_s: float
    steps: int  # engine steps that produced at least one output
    others_cpu_s: float = 0.0  # every other process on the machine in the window (noise)
    forward_steps: int = 0  # engine steps that ran a forward pass (pdserve:engine_steps)

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_s / self.output_tokens

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def make_engine(model: str, max_num_seqs: int, **engine_kwargs):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine

    args = EngineArgs.from_kwargs(model, max_num_seqs=max_num_seqs, **engine_kwargs)
    return LLMEngine(args.create_engine_config())


def make_pd_engines(model: str, max_num_seqs: int, **engine_kwargs):
    """A prefill and a decode engine in this process, their KV connectors joined by an
    in-process transport: the P/D engines' own work (two schedulers, two forward passes per
    round, the prompt KV copied out and in) with nothing of the serving layer."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from kvstore.connector import PDConnector
    from kvstore.transports import LocalTransport

    config = EngineArgs.from_kwargs(model, max_num_seqs=max_num_seqs, **engine_kwargs).create_engine_config()
    transport = LocalTransport()

    def engine(pd_role: str):
        def factory(side):
            return PDConnector(side, pd_role, transport, f"offline-{pd_role}", config.cache.block_size)
        return LLMEngine(config, factory)
    return engine("producer"), engine("consumer")


def _params(max_tokens: int) -> SamplingParams:
    # What the HTTP client asks for: greedy, EOS ignored.
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_closed_loop(engine, prompts: list[str], max_tokens: int, concurrency: int, tag: str,
                    on_step=None) -> tuple[int, int]:
    """Keep `concurrency` requests in the engine, adding the next prompt as one finishes (the
    engine's view of `concurrency` closed-loop clients). (output tokens, steps with output);
    `on_step(outputs)` sees each step's RequestOutputs."""
    queue = deque(enumerate(prompts))
    active = 0
    tokens = steps = 0
    while queue or active:
        while queue and active < concurrency:
            i, prompt = queue.popleft()
            engine.add_request(f"{tag}-{i}", prompt, _params(max_tokens))
            active += 1
        outputs = engine.step()
        if outputs:
            steps += 1
            if on_step is not None:
                on_step(outputs)
        for out in outputs:
            tokens += len(out.delta_token_ids)
            active -= out.finished
    return tokens, steps


def run_closed_loop_pd(prefill, decode, prompts: list[str], max_tokens: int, concurrency: int, tag: str) -> int:
    """run_closed_loop over a prefill and a decode engine (make_pd_engines), every request
    disaggregated as the cluster does it (cluster.pd.split): the prompt with max_tokens=1 on
    `prefill`, exporting its KV, then the rest on `decode`, loading it. Each round steps both
    engines. Returns the output tokens."""
    params = _params(max_tokens)
    queue = deque(enumerate(prompts))
    requests = {}  # request id -> its EngineRequest, processed once
    active = tokens = 0
    while queue or active:
        while queue and active < concurrency:
            i, prompt = queue.popleft()
            request = requests[f"{tag}-{i}"] = prefill.process(prompt, params, f"{tag}-{i}")
            prefill.add(prefill_request(request))
            active += 1
        for out in prefill.step() if prefill.has_work() else []:
            first = out.outputs[0]
            tokens += len(out.delta_token_ids)
            if not out.finished:
                continue
            request = requests.pop(out.request_id)
            if needs_decode(first.finish_reason, request):
                decode.add(decode_request(request, out))
            else:
                active -= 1
        for out in decode.step() if decode.has_work() else []:
            tokens += len(out.delta_token_ids)
            active -= out.finished
    return tokens


def measure_offline(engine, prompts: list[str], max_tokens: int, concurrency: int, warm: list[str]) -> OfflineRun:
    """CPU and wall time of the engine alone on the benchmark's requests, after a warm-up on
    other prompts (the measured ones must not be in the prefix cache)."""
    run_closed_loop(engine, warm[:concurrency], 4, concurrency, f"warm-c{concurrency}")
    cpu0, t0, forward0 = time.process_time(), time.perf_counter(), engine.core.num_steps
    tokens, steps = run_closed_loop(engine, prompts, max_tokens, concurrency, f"run-c{concurrency}")
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return OfflineRun(concurrency, len(prompts), tokens, cpu, wall, steps,
                      forward_steps=engine.core.num_steps - forward0)


def measure_offline_pd(engines, prompts: list[str], max_tokens: int, concurrency: int, warm: list[str]) -> OfflineRun:
    """measure_offline for the P/D engine pair (make_pd_engines): CPU per output token of the
    disaggregated engines alone, the floor of a P/D server's on the same requests."""
    prefill, decode = engines
    run_closed_loop_pd(prefill, decode, warm[:concurrency], 4, concurrency, f"warm-pd-c{concurrency}")
    cpu0, t0 = time.process_time(), time.perf_counter()
    steps0 = prefill.core.num_steps + decode.core.num_steps
    tokens = run_closed_loop_pd(prefill, decode, prompts, max_tokens, concurrency, f"run-pd-c{concurrency}")
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    steps = prefill.core.num_steps + decode.core.num_steps - steps0
    return OfflineRun(concurrency, len(prompts), tokens, cpu, wall, steps, forward_steps=steps)


@dataclass(frozen=True)
class Message:
    nbytes: int  # pickled size of the list of RequestDeltas
    deltas: int
    finishing: bool  # carries a request's last delta (finish reason, metrics)


@dataclass
class MessageSizes:
    prompt_tokens: int
    requests: int
    messages: list[Message]
    request_output_bytes: list[int]  # pickled size of each RequestOutput (one per token before)

    def steady(self) -> list[Message]:
        """Decode messages of the full batch: every request has one delta, none finishes."""
        return [m for m in self.messages if m.deltas == self.requests and not m.finishing]

    @property
    def mean_bytes(self) -> float:
        return sum(m.nbytes for m in self.messages) / len(self.messages)

    @property
    def steady_bytes(self) -> float | None:
        steady = self.steady()
        return sum(m.nbytes for m in steady) / len(steady) if steady else None

    @property
    def deltas_per_message(self) -> float:
        return sum(m.deltas for m in self.messages) / len(self.messages)

    @property
    def mean_request_output_bytes(self) -> float:
        return sum(self.request_output_bytes) / len(self.request_output_bytes)


def measure_message_sizes(engine, prompts: list[str], prompt_tokens: int, max_tokens: int) -> MessageSizes:
    """Run the prompts together and build, from each step's outputs, the message an engine
    replica sends one ingress (cluster.replica.step_channel.IngressChannel: RequestDelta.of per
    output, one list per step); size it as Ray would ship it (pickle protocol 5).
    Each RequestOutput (the old per-token unit) is pickled beside it, for contrast."""
    from cluster.replica.step_channel import IngressChannel

    channel = IngressChannel()
    sizes = MessageSizes(prompt_tokens, len(prompts), [], [])

    def on_step(outputs) -> None:
        for out in outputs:
            channel.active.add(out.request_id)
            channel.put(out)
            sizes.request_output_bytes.append(len(pickle.dumps(out, protocol=5)))
        batch = channel.take()
        sizes.messages.append(Message(len(pickle.dumps(batch, protocol=5)), len(batch),
                                      any(d.finished for d in batch)))

    run_closed_loop(engine, prompts, max_tokens, len(prompts), f"bytes-{prompt_tokens}", on_step)
    return sizes
