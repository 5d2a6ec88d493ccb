"""Offline API (vLLM-compatible): `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.args import EngineArgs
from engine.errors import ParameterError
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.metrics import Metric
from engine.outputs import RequestOutput
from engine.parallel_sampling import child_request_id, child_requests, merge_children
from engine.pooling.outputs import (
    PoolingRequestOutput,
    ScoringOutput,
    classification_output,
    embedding_output,
    score_inputs,
)
from engine.pooling.params import PoolingParams
from engine.processor import PromptType
from engine.sampling_params import SamplingParams


class LLM:
    """Batch generation over one in-process engine. Keyword arguments are `EngineArgs`
    fields (docs/engine.md#engine-arguments); an unknown one is a ParameterError listing them."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.engine = LLMEngine(self.engine_args.create_engine_config())
        self._counter = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**{f: getattr(engine_args, f) for f in EngineArgs.field_names()})

    def shutdown(self) -> None:
        """Stop the engine's workers (tensor-parallel rank processes); idempotent."""
        self.engine.core.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt, as vLLM takes it (needs enable_lora)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ParameterError(
                    "sampling_params", f"sampling_params must be one SamplingParams or one per prompt "
                    f"({len(prompts)}), got {len(params)}"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ParameterError("priority", f"priority must have one entry per prompt ({len(prompts)}), got {len(priority)}")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ParameterError("lora_request", f"lora_request must be one LoRARequest or one per prompt "
                                 f"({len(prompts)}), got {len(loras)}")

        # One entry per prompt: (request id, the ids of its n children; [id] when n == 1).
        requests: list[tuple[str, list[str]]] = []
        queued: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                self._counter += 1
                rid = f"offline-{self._counter}"
                children = [rid] if p.n == 1 else [child_request_id(rid, j) for j in range(p.n)]
                requests.append((rid, children))
                # Processed once; its n samples differ only in their params (seeds).
                request = self.engine.process(prompt, p, rid, priority=priority[i] if priority else 0,
                                              lora_request=loras[i])
                for child in child_requests(request, children):
                    queued.append(self.engine.add(child))
        except ValueError:
            self.engine.abort_request(queued)  # nothing of a rejected batch stays queued
            raise
        finished = self._run(queued, use_tqdm)
        return [finished[rid] if children == [rid] else merge_children(rid, [finished[c] for c in children])
                for rid, children in requests]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), from an engine with runner="pooling"
        (convert="embed"); `pooling_params.dimensions` shortens a Matryoshka model's."""
        return [embedding_output(o) for o in self._pool(prompts, pooling_params, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`), from a classify model."""
        return [classification_output(o) for o in self._pool(prompts, None, use_tqdm)]

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Relevance of each (data_1, data_2) pair (`outputs.score`): one data_1 against every
        data_2, or pairs of equal-length lists. A classify model (a cross-encoder, or an LLM with
        classifier_from_token) scores each pair as one prompt; an embedding model answers the
        cosine similarity of the two texts' embeddings (texts or prompt dicts; a classify model's
        pairs are texts, encoded as the tokenizer encodes a pair)."""
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if len(first) not in (1, len(second)) or not second:
            raise ParameterError("data_2", f"data_1 must be one text or as many as data_2 ({len(second)}), "
                                 f"got {len(first)}")
        pooling = self.engine.processor.pooling
        prompts, scores = score_inputs(self.engine.tokenizer, pooling.task if pooling else "classify", first, second)
        outs = self._pool(prompts, None, use_tqdm)
        pairs = outs if len(outs) == len(second) else outs[-len(second):]  # embeddings: a pair's second text
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(s))
                for o, s in zip(pairs, scores([o.pooled for o in outs]))]

    def _pool(self, prompts, pooling_params: PoolingParams | None, use_tqdm: bool) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = pooling_params or PoolingParams()
        ids: list[str] = []
        try:
            for prompt in prompts:
                self._counter += 1
                request = self.engine.process(prompt, SamplingParams(max_tokens=1), f"offline-{self._counter}",
                                              pooling_params=params)
                ids.append(self.engine.add(request))
        except ValueError:
            self.engine.abort_request(ids)
            raise
        finished = self._run(ids, use_tqdm)
        return [finished[rid] for rid in ids]

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            try:
                while pending:
                    outputs = self.engine.step()
                    if not outputs:
                        self.engine.wait_while_waiting()
                    for out in outputs:
                        if out.finished and out.request_id in pending:
                            finished[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update(1)
            except BaseException:
                self.engine.abort_request(list(pending))
                raise
        return finished

    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms under vLLM's names, as vLLM's `LLM.get_metrics()`."""
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.engine.core.reset_prefix_cache()
