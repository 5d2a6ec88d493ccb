"""EngineCore: one step = schedule -> execute -> update_from_output (docs/architecture.md#engine-core-client).

Token ids in, token ids out; tokenization, detokenization and stop strings live in the
LLMEngine around it. Never imports Ray: actors wrap it.
"""

from __future__ import annotations

import logging
import pickle
from concurrent.futures import Future

import torch

import kernels
from engine.config import EngineConfig, ParallelConfig, resolved_token_budget
from engine.distributed import SINGLE_DP, DPPlacement
from engine.errors import ParameterError
from engine.executor import Executor, WorkerConfig, executor_class
from engine.kv_cache import KVCacheManager
from engine.kv_cache.events import EngineKVEvents
from engine.kv_cache.hybrid import kv_groups, split_blocks, window_blocks_bound
from engine.kv_connector import KVConnectorFactory, KVConnectorRole
from engine.kv_offload import with_offloading
from engine.load import EngineLoad, SpecDecodeCounts, summed_counters
from engine.lora.sched import LoRAUsage
from engine.models.arch import ModelArch, load_arch
from engine.models.gguf_file import find_gguf
from engine.models.llava import load_vision_arch
from engine.models.loader import resolve_dtype
from engine.models.parallel import check_ep_size, check_tp_size
from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.pooling.config import engine_pooling
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput
from engine.sched.scheduler import Scheduler
from engine.spec_decode.config import check_draft_vocab
from engine.structured_output import BACKENDS, DEFAULT_BACKEND, StructuredOutputManager
from engine.tokenizer import eos_token_ids, load_tokenizer
from kernels.cpu.build import level_in_use

logger = logging.getLogger(__name__)

# Without a size from the user, a CPU engine takes this much memory for KV at most.
_CPU_DEFAULT_KV_GB = 1.0
_WARMUP_TOKENS = 512


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len must be <= {limit} for this model, got {requested}")
    return requested


def check_parallel(arch: ModelArch, device: torch.device, parallel: ParallelConfig) -> None:
    """ParameterError unless this model shards over `parallel`'s ranks on this machine."""
    tp = parallel.tensor_parallel_size
    check_tp_size(arch, tp, expert_parallel=parallel.expert_parallel_size > 1)
    if parallel.enable_expert_parallel and not arch.num_experts:
        raise ParameterError("enable_expert_parallel", "enable_expert_parallel needs a mixture-of-experts "
                             f"model (Qwen3-MoE, Mixtral); {arch.architecture} has no experts")
    check_ep_size(arch, parallel.expert_parallel_size)
    if device.type == "cuda" and tp > torch.cuda.device_count():
        raise ParameterError(
            "tensor_parallel_size",
            f"tensor_parallel_size={tp} needs one GPU per rank; {torch.cuda.device_count()} visible",
        )


def check_speculative(config: EngineConfig, arch: ModelArch) -> None:
    """ParameterError unless this engine can run the speculative config it was given."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return
    check_draft_vocab(arch.vocab_size, load_arch(spec.model).vocab_size)
    if config.parallel.tensor_parallel_size > 1:
        raise ParameterError("speculative_config.method", "speculative_config.method 'draft_model' runs on "
                             "one rank; use tensor_parallel_size=1 or method 'ngram'")


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    return int(memory_bytes // bytes_per_block)


class EngineCore:
    """Scheduler + KV cache manager + an Executor. `kv_connector_factory` makes each side of
    the KV connector (engine.kv_connector), if any: the scheduler side here, the worker side
    on each worker. It is also the in-process core client (engine.core_client)."""

    runs_apart = False

    def __init__(self, config: EngineConfig, kv_connector_factory: KVConnectorFactory | None = None,
                 executor_cls: type[Executor] | None = None, dp: DPPlacement = SINGLE_DP,
                 tokenizer_from_front_end: bool = False) -> None:
        """`tokenizer_from_front_end`: a front end (LLMEngine) will give this core its tokenizer
        (give_tokenizer), and the structured-output backend is built from it then; otherwise
        it is built now from a tokenizer the core loads itself."""
        self.config = config
        mc, cc = config.model, config.cache
        self.arch = load_arch(mc.model)
        self.device = resolve_device(mc.device)
        check_parallel(self.arch, self.device, config.parallel)
        check_speculative(config, self.arch)
        self.scheduler_config = sc = resolved_token_budget(config.scheduler, self.device.type)
        self.dtype = resolve_dtype(mc.dtype, self.arch, self.device)
        self.max_model_len = resolve_max_model_len(mc.max_model_len, self.arch)
        backend = config.kernel_backend
        if backend == "auto":
            backend = kernels.default_backend(self.device.type)
        self.kernel_backend = backend
        self.pooling = engine_pooling(config.pooling, mc.model, self.arch.hidden_size)  # None: it generates
        worker_config = WorkerConfig(config, self.arch, self.device, self.dtype, self.max_model_len, sc, backend, dp,
                                     self.pooling)
        if executor_cls is None:
            executor_cls = executor_class(config.parallel.executor_backend)
        if config.kv_shared_tier is not None and not getattr(kv_connector_factory, "provides_shared_tier", False):
            # The shared tier lives in the cluster's KV store (kvstore.shared_tier), which a
            # replica host builds; an engine on its own has no cluster to share with.
            logger.warning("kv_shared_tier_size=%g is ignored: the shared KV tier needs a serving replica "
                           "(pdserve serve); this engine has none", config.kv_shared_tier.size_gb)
        # The host KV tier (engine.kv_offload) composes with whatever connector was given.
        kv_connector_factory = with_offloading(config, self.arch, self.dtype, kv_connector_factory)
        self.executor = executor_cls(worker_config, kv_connector_factory)
        spec = config.speculative
        self.kv_groups = kv_groups(self.arch, disabled=cc.disable_hybrid_kv_cache_manager,
                                   draft_model=bool(spec and spec.method == "draft_model"))
        num_blocks, num_window_blocks = self._determine_num_blocks()
        if self.device.type == "cpu":
            # One throwaway forward, so the first real request does not pay for first-touch
            # allocations and kernel set-up (measured ~1.7 s on the small model). On CUDA the
            # memory profile run above already did this.
            # Under the Triton interpreter (tests of the kernel path) a 512-token forward costs
            # about a minute and warms nothing worth having: a few tokens exercise the same code.
            warmup = _WARMUP_TOKENS if backend == "torch" else 8
            self.executor.profile_run(min(sc.max_num_batched_tokens, warmup))
        self.executor.initialize_kv_cache(num_blocks, num_window_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, main_window=self.kv_groups.main_window,
            window=self.kv_groups.window, num_window_blocks=num_window_blocks)
        self.connector = (kv_connector_factory(KVConnectorRole.SCHEDULER)
                          if kv_connector_factory is not None else None)
        # What this core's prefix cache (and its connector's tiers) stored and dropped, for a
        # KV-aware router (docs/kv_cache.md#kv-events); `last_kv_events` is the last step's.
        self.kv_events = self.last_kv_events = None
        if cc.enable_kv_cache_events and cc.enable_prefix_caching:
            self.kv_events = EngineKVEvents(self.kv_cache_manager, self.connector)
        self.idle = True
        lc = config.lora
        self.lora_usage = None if lc is None else LoRAUsage(lc.max_loras, lc.cpu_capacity)
        self.last_step_ran_model = False  # whether the last step was a forward pass
        # Cumulative: forward passes and the tokens they ran (prompt and generated), so a reader
        # sees how full the steps were (pdserve:engine_steps / engine_step_tokens).
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.structured_output_manager = StructuredOutputManager(
            self._structured_output_backend, self.arch.vocab_size, sc.max_num_seqs)
        self._wakeup = None
        self.encoder_cache, encoder_budget = self._encoder_cache(sc.max_num_batched_tokens)
        self.scheduler = Scheduler(sc, cc, self.kv_cache_manager, self.max_model_len, self.connector,
                                   self.structured_output_manager, self.encoder_cache, encoder_budget,
                                   num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                   num_lookahead_tokens=(spec.num_speculative_tokens
                                                         if spec and spec.method == "draft_model" else 0),
                                   max_loras=config.lora.max_loras if config.lora is not None else 0)
        # Last, so that the build does not compete with the profile run above (vLLM also
        # builds its grammar backend's tokenizer data at start-up).
        self._given_tokenizer = None
        self.structured_output_backend_built: Future | None = None
        if not tokenizer_from_front_end:
            self.structured_output_backend_built = self.structured_output_manager.prebuild()
        tokens = num_blocks * cc.block_size
        # Named where users look (this line, /status): the level decides much of a CPU's speed.
        self.cpu_kernels = level_in_use() if self.device.type == "cpu" else None
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; max concurrency %.2fx at %d tokens/request%s%s",
            num_blocks, cc.block_size, tokens, tokens / self.max_model_len, self.max_model_len,
            f"; sliding-window layers: {num_window_blocks} blocks of their own" if num_window_blocks else "",
            f"; CPU kernels: {self.cpu_kernels}" if self.cpu_kernels else "",
        )

    def _determine_num_blocks(self) -> tuple[int, int]:
        """(main group blocks, window group blocks; 0 without one: engine.kv_cache.hybrid)."""
        cc, sc = self.config.cache, self.scheduler_config
        per_block = self.executor.kv_bytes_per_block()
        blocks_per_seq = -(-self.max_model_len // cc.block_size)
        groups = self.kv_groups
        memory = None
        if cc.num_kv_blocks is not None:
            n = cc.num_kv_blocks
        elif cc.kv_cache_memory_gb is not None:
            memory = int(cc.kv_cache_memory_gb * 2**30)
        elif self.device.type == "cuda":
            memory = self.executor.determine_available_memory()
        else:
            memory = int(_CPU_DEFAULT_KV_GB * 2**30)
        num_window = 0
        if groups.hybrid:
            # A block of each group costs its own layers' share of a block of every layer.
            window_bytes = per_block * groups.num_window_layers // self.arch.num_layers
            spec = self.config.speculative
            bound = window_blocks_bound(groups.window, cc.block_size, sc.max_num_seqs, sc.max_num_batched_tokens,
                                        spec.num_speculative_tokens if spec else 0)
            n, num_window = split_blocks(None if memory is not None else n, memory, per_block - window_bytes,
                                         window_bytes, bound)
        elif memory is not None:
            n = num_blocks_for_memory(memory, per_block)
        if memory is not None and cc.kv_cache_memory_gb is None and self.device.type != "cuda":
            # No point in more blocks than max_num_seqs full-length requests can use.
            n = min(n, blocks_per_seq * sc.max_num_seqs)
        if n < blocks_per_seq:
            raise ValueError(
                f"KV cache of {n} blocks ({n * cc.block_size} tokens) cannot hold one request of "
                f"max_model_len={self.max_model_len}; raise num_kv_blocks/kv_cache_memory_gb to at "
                f"least {blocks_per_seq} blocks or lower max_model_len"
            )
        return n, num_window

    def _encoder_cache(self, step_tokens: int) -> tuple[EncoderCacheManager | None, int]:
        """(encoder cache bookkeeping, per-step encoder budget); (None, 0) for a text model."""
        model_dir = self.config.model.model
        vision = None if find_gguf(model_dir) is not None else load_vision_arch(model_dir)
        if vision is None:
            return None, 0
        size, budget = self.config.multimodal.budgets(step_tokens, vision.tokens_per_image)
        return EncoderCacheManager(size), budget

    def give_tokenizer(self, pickled: bytes | None) -> None:
        """The front end's tokenizer (engine.tokenizer.pickled_tokenizer; None: it did not
        pickle): the structured-output backend is built from this copy, on a compile thread,
        instead of from the tokenizer loaded again. A core that started its build already
        keeps it."""
        if self.structured_output_backend_built is not None or self.structured_output_manager.backend_ready:
            return
        self._given_tokenizer = pickled  # unpickled on the compile thread, off this one
        self.structured_output_backend_built = self.structured_output_manager.prebuild()

    def _structured_output_backend(self):
        """Built on a compile thread when the engine starts or its front end gives it the
        tokenizer (see the manager's prebuild; a build that failed is retried by the first
        structured request)."""
        pickled, self._given_tokenizer = self._given_tokenizer, None
        tokenizer = None
        if pickled is not None:
            try:
                tokenizer = pickle.loads(pickled)
            except Exception:  # noqa: BLE001 - e.g. a core on a node whose transformers differs
                logger.warning("the front end's tokenizer did not unpickle; loading it again", exc_info=True)
        if tokenizer is None:
            tokenizer = load_tokenizer(self.config.model.model)
        eos = eos_token_ids(self.config.model.model, tokenizer)
        return BACKENDS[DEFAULT_BACKEND](tokenizer, self.arch.vocab_size, eos)

    def set_kv_wakeup(self, callback) -> None:
        """`callback` (any thread) wakes a driver loop blocked while every request waits for
        remote KV (the worker side calls it when a load completes) or for its grammar."""
        self._wakeup = callback
        self.executor.set_kv_wakeup(callback)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker rank is gone (callable from any thread)."""
        self.executor.check_health()

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is not None:
            # NOTE: a P/D decode request's prompt ends with output tokens sampled elsewhere;
            # its matcher replays them, so it continues where the prefill's left off.
            kv = request.kv_transfer_params
            prior = kv.num_prior_output_tokens if kv is not None else 0
            so_request = self.structured_output_manager.grammar_init(
                params, request.prompt_token_ids[len(request.prompt_token_ids) - prior:])
            request.structured_output_request = so_request
            request.status = RequestStatus.WAITING_FOR_FSM
            if self._wakeup is not None:
                wakeup = self._wakeup
                so_request.grammar_future.add_done_callback(lambda _: wakeup())
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str], status=RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        self.last_step_ran_model = False
        if not self.scheduler.has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        if self.lora_usage is not None:
            self.lora_usage.scheduled(scheduler_output.scheduled_new_reqs)
        runner_output = self.executor.execute_model(scheduler_output)
        self.last_step_ran_model = not scheduler_output.is_empty
        if self.last_step_ran_model:
            self.num_steps += 1
            self.num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        # Nothing was computed (e.g. every request waits for remote KV) and no transfer
        # finished: the driver loop may block until woken.
        self.idle = scheduler_output.is_empty and runner_output.kv_connector_output is None
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.kv_events is not None:
            self.last_kv_events = self.kv_events.end_step()
        return outputs

    def kv_snapshot(self):
        """Every prefix block this core holds, per medium, as a KVSnapshot
        (engine.kv_cache.events); None when KV events are off."""
        return None if self.kv_events is None else self.kv_events.snapshot()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def wake(self) -> None:
        """A caller queued work for the loop driving this core: this core never blocks, so
        there is nothing to interrupt (clients of cores apart wait on their cores)."""

    def core_pids(self) -> list[int]:
        return []  # the core is in this process

    def core_actors(self) -> list:
        return []

    def rank_actors(self) -> list:
        return self.executor.rank_actors()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) requests: what a core loop reports after every step."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.get_num_free_blocks()

    def execute_dummy_batch(self) -> None:
        """A forward pass on no tokens, touching no KV: a data-parallel core with nothing to
        run keeps its peers' expert-parallel collectives going (engine.dp.core_loop)."""
        self.executor.execute_dummy_batch()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def kv_transfer_stats(self) -> dict:
        """The KV connector's counters (exports, loads, bytes, ...) summed over the ranks, each
        of which moves its own heads; {} without a connector."""
        return summed_counters(self.executor.collective_rpc("kv_transfer_stats"))

    def kv_outbox_size(self) -> int:
        """Exports the ranks still hold for the KV store to take."""
        return sum(self.executor.collective_rpc("kv_outbox_size"))

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    def load(self, fresh: bool = True) -> EngineLoad:
        """Load figures for routing, health and metrics (`fresh` is for core clients whose
        cores run elsewhere: this one always reads its own)."""
        kv, stats, remote = self.kv_cache_manager, self.scheduler.spec_stats, self.scheduler.remote_kv
        encoder = self.encoder_cache.stats if self.encoder_cache is not None else None
        return EngineLoad(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            free_blocks=kv.get_num_free_blocks(),
            total_blocks=kv.num_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            external_prefix_cache_queries=remote.queries if remote else 0,
            external_prefix_cache_hits=remote.hits if remote else 0,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.num_scheduled_tokens,
            # Zeros for a text-only model: every engine reports the same metric set.
            encoder_cache_queries=encoder.queries if encoder else 0,
            encoder_cache_hits=encoder.hits if encoder else 0,
            encoder_seconds=self.scheduler.encoder_seconds,
            spec_decode=None if stats is None else SpecDecodeCounts(
                stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                tuple(stats.num_accepted_tokens_per_pos)),
            lora=None if self.lora_usage is None else self.lora_usage.figures(self.scheduler.running,
                                                                              self.scheduler.waiting),
            cpu_kernels=self.cpu_kernels,
        )
