"""LLMEngine: input processing + EngineCore + output processing, driven step by step."""

from __future__ import annotations

import threading

from engine.config import EngineConfig
from engine.core import resolve_max_model_len
from engine.core_client import CoreClient, make_core_client
from engine.engine_request import EngineRequest
from engine.errors import ParameterError
from engine.kv_connector import KVConnectorFactory
from engine.kv_transfer_params import KVTransferParams
from engine.lora.check import LoRAChecker
from engine.lora.request import LoRARequest
from engine.metrics import Metric, StatsRecorder
from engine.models.arch import ModelArch, load_arch
from engine.models.gguf_file import find_gguf
from engine.models.llava import load_vision_arch
from engine.multimodal.processor import MultiModalProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.pooling.config import engine_pooling
from engine.processor import InputProcessor, PromptType
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import eos_token_ids, load_tokenizer, pickled_tokenizer

# How long an offline driver waits to be woken while every request waits (for KV or a
# grammar): the server's engine loop polls at the same bound (engine.async_llm).
IDLE_WAIT_S = 0.05


def load_processor(config: EngineConfig) -> tuple[object, InputProcessor]:
    """(tokenizer, InputProcessor) of a model without loading its weights: what the HTTP
    ingress needs to build each EngineRequest exactly as the engine would."""
    model_dir = config.model.model
    arch = load_arch(model_dir)  # first: its errors name what is wrong with the path
    tokenizer = load_tokenizer(model_dir)
    max_len = resolve_max_model_len(config.model.max_model_len, arch)
    return tokenizer, input_processor(config, tokenizer, max_len, arch)


def input_processor(config: EngineConfig, tokenizer, max_model_len: int, arch: ModelArch) -> InputProcessor:
    model_dir = config.model.model
    vision = None if find_gguf(model_dir) is not None else load_vision_arch(model_dir)
    mm = None if vision is None else MultiModalProcessor(
        model_dir, vision, tokenizer, config.multimodal.limit_mm_per_prompt)
    return InputProcessor(tokenizer, max_model_len, arch.vocab_size, eos_token_ids(model_dir, tokenizer), mm,
                          max_logprobs=config.model.max_logprobs, lora_check=LoRAChecker(config.lora, arch),
                          pooling=engine_pooling(config.pooling, model_dir, arch.hidden_size, tokenizer))


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None) -> None:
        self.config = config
        model_dir = config.model.model
        # First: it validates the model path.
        self.core: CoreClient = make_core_client(config, kv_connector_factory)
        try:
            self.tokenizer = load_tokenizer(model_dir)
            self.core.give_tokenizer(pickled_tokenizer(self.tokenizer))
            self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
            self.processor = input_processor(config, self.tokenizer, self.core.max_model_len, self.core.arch)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.stats = StatsRecorder(model_dir, self.core.max_model_len)
            # Offline drivers step in a loop. While every request only waits (for KV that a
            # tier or a P/D peer is fetching, or for its grammar), a step computes nothing, and
            # a loop without a pause would hold the GIL against the very thread fetching.
            # (AsyncLLM sets its own callback: its loop blocks on its inputs instead.)
            self._woken = threading.Event()
            self.core.set_kv_wakeup(self._woken.set)
        except BaseException:
            self.core.shutdown()  # a core process or actors would otherwise outlive the failed start
            raise

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def process(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                **fields) -> EngineRequest:
        """The EngineRequest of a prompt (InputProcessor.process; `fields`: its priority,
        cache_salt, kv_transfer_params, lora_request)."""
        return self.processor.process(prompt, params, request_id, **fields)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Process and queue a prompt (the offline API); raises ParameterError on bad input."""
        return self.add(self.processor.process(prompt, params, request_id, priority, cache_salt,
                                               kv_transfer_params, lora_request))

    def add(self, request: EngineRequest) -> str:
        """Queue a processed request, checked against this engine's limits (a ParameterError),
        never tokenized again. The engine runs n=1 requests: LLM.generate and the HTTP ingress
        fan `n` > 1 out (engine.parallel_sampling)."""
        self.processor.check(request)
        params = request.sampling_params
        if params.n != 1:
            raise ParameterError("n", f"n={params.n}: this engine API takes n=1 requests; LLM.generate and the "
                                 "HTTP server fan n > 1 out into n requests (engine.parallel_sampling)")
        core_request = Request.of(request)
        self.core.add_request(core_request)
        self.output_processor.add_request(core_request, request.prompt)
        self.stats.request_added(core_request.request_id, core_request.arrival_time)
        return request.request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        for rid in ids:
            self.output_processor.remove(rid)
            self.stats.request_aborted(rid)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.stats.record(outputs)
        return outputs

    def wait_while_waiting(self, bound_s: float = IDLE_WAIT_S) -> None:
        """After a step that computed nothing because every request waits (a KV load, a
        grammar): block until one is ready, at most `bound_s`; otherwise return at once. A
        wake-up lost between two steps costs at most the bound."""
        if getattr(self.core, "idle", False) and self.core.has_work():
            self._woken.wait(bound_s)
        self._woken.clear()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_work(self) -> bool:
        """A step is needed (see Scheduler.has_work); drivers step while this holds."""
        return self.core.has_work()

    def get_num_unfinished_requests(self) -> int:
        return self.core.get_num_unfinished_requests()

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics (and pdserve's engine figures) for this engine, cumulative since it
        started, labelled model_name (the model directory, as vLLM's default served name)."""
        return self.stats.snapshot(self.core.load().figures())
