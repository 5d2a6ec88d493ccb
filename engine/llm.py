"""Offline API (vLLM-compatible): `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import SamplingParams


def build_engine_config(
    model: str,
    dtype: str = "auto",
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    long_prefill_token_threshold: int = 0,
    max_model_len: int | None = None,
    kv_cache_memory_gb: float | None = None,
    num_kv_blocks: int | None = None,
    scheduling_policy: str = "fcfs",
    seed: int = 0,
    device: str = "auto",
    kernel_backend: str = "auto",
    kernel_block_size: int | None = None,
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_gb=kv_cache_memory_gb,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            kernel_block_size=kernel_block_size,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy,
        ),
        kernel_backend=kernel_backend,
        enforce_eager=enforce_eager,
    )


class LLM:
    """Batch generation over one in-process engine. Keyword arguments are those of
    `build_engine_config` (ARCHITECTURE.md §3)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
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
                raise ValueError(
                    f"sampling_params must be one SamplingParams or one per prompt "
                    f"({len(prompts)}), got {len(params)}"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority must have one entry per prompt ({len(prompts)}), got {len(priority)}")

        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                self._counter += 1
                rid = self.engine.add_request(
                    f"offline-{self._counter}", prompt, p, priority=priority[i] if priority else 0
                )
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)  # nothing of a rejected batch stays queued
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            try:
                while pending:
                    for out in self.engine.step():
                        if out.finished and out.request_id in pending:
                            finished[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update(1)
            except BaseException:
                self.engine.abort_request(list(pending))
                raise
        return [finished[rid] for rid in ids]

    def reset_prefix_cache(self) -> bool:
        return self.engine.core.reset_prefix_cache()
