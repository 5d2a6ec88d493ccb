"""Runs one scheduled step: flattened super-sequence in, one sampled token per finished prefill
or decode out; with speculative decoding, a decode also verifies its drafts and emits every
accepted one plus one more token."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch

from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.lora.config import LoRAConfig
from engine.lora.runner import LoRARunner
from engine.models.arch import ModelArch
from engine.models.attention_metadata import AttentionMetadata
from engine.models.loader import load_model
from engine.pooling.config import PoolingModel
from engine.pooling.pooler import Pooler
from engine.sample import Sampler
from engine.sample.rejection_sampler import rejection_sample
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.spec_decode import NgramProposer, SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.structured_output.bitmask import bitmask_for_sampled_rows
from engine.worker.block_table import kv_cache_tensors
from engine.worker.buffers import StagedBuffer
from engine.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from engine.worker.dry_runs import dummy_forward, profile_forward
from engine.worker.encoder_runner import EncoderRunner
from engine.worker.input_batch import InputBatch
from engine.worker.prompt_logprobs import prompt_spans, score_prompt
from engine.worker.sampling_metadata import sampling_metadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        arch: ModelArch,
        ops: SimpleNamespace,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        kernel_block_size: int,
        use_cuda_graphs: bool = False,
        tp: TPGroup = SINGLE_RANK,
        ep: EPGroup = SINGLE_EP,
        speculative: SpeculativeConfig | None = None,
        quantization: str | None = None,
        lora: LoRAConfig | None = None,
        pooling: PoolingModel | None = None,
    ) -> None:
        self.arch = arch
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.max_model_len = max_model_len
        self.model = load_model(model_dir, arch, ops, device, dtype, max_model_len, tp, ep, quantization)
        if device.type == "cpu":
            self.model.pack_cpu_weights()
        self.lora = None if lora is None else LoRARunner(self.model, arch, lora, ops, device, dtype)
        # KV heads this rank caches (all of them on one rank).
        self.num_kv_heads = self.model.layout.num_kv_heads
        self.sampler = Sampler()
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size, kernel_block_size, device)
        # A prefill chunk is capped by the token budget; a step never exceeds it.
        T, R = max_num_batched_tokens, max_num_seqs
        self.input_ids = StagedBuffer(T, torch.int64, device)
        self.positions = StagedBuffer(T, torch.int64, device)
        self.slot_mapping = StagedBuffer(T, torch.int64, device)
        self.query_start_loc = StagedBuffer(R + 1, torch.int32, device)
        self.seq_lens = StagedBuffer(R, torch.int32, device)
        self.step_block_table = StagedBuffer(
            (R, self.input_batch.block_table.max_blocks), torch.int32, device
        )
        self.window_slot_mapping: StagedBuffer | None = None  # a hybrid model's window group
        self.window_step_block_table: StagedBuffer | None = None
        # Each logits row is a scheduled token, so T bounds them even when drafts are verified.
        self.logits_indices = StagedBuffer(max(R, T), torch.int64, device)
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                          speculative.prompt_lookup_max)
        elif speculative is not None:
            self.proposer = DraftModelProposer(speculative.model, speculative.num_speculative_tokens, ops, device,
                                               dtype, max_model_len, block_size, kernel_block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The draft model runs on each step's inputs, which the decode graphs do not expose.
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda" and not self._drafts_by_model
        self.decode_graphs: DecodeGraphs | None = None
        # Image models only: encoder outputs by image hash, merged into prefill embeddings.
        self.encoder = EncoderRunner(self.model, device) if hasattr(self.model, "encode_images") else None
        # A pooling model (engine.pooling): its requests end at their prompt with a vector.
        self.pooler = None if pooling is None else Pooler.load(pooling, model_dir, dtype, device)

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        target = 2 * a.num_layers * self.block_size * self.num_kv_heads * a.head_dim * itemsize
        # A draft model's KV lives in the same block ids: a block costs both.
        return target + (self.proposer.kv_bytes_per_block() if self._drafts_by_model else 0)

    @property
    def _drafts_by_model(self) -> bool:
        return isinstance(self.proposer, DraftModelProposer)

    def initialize_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """Allocate [num_kernel_blocks, kernel_block_size, Hkv, D] K and V per layer: a hybrid
        model's sliding-window layers (num_window_blocks > 0) from the window group's pool,
        with a block table of their own (engine.kv_cache.manager)."""
        window_layers = {i for i in range(self.arch.num_layers) if self.arch.window(i)} if num_window_blocks else set()
        self.layer_groups = [int(i in window_layers) for i in range(self.arch.num_layers)]
        self.kv_caches = [kv_cache_tensors(num_window_blocks if i in window_layers else num_blocks, self.block_size,
                                           self.kernel_block_size, self.num_kv_heads, self.arch.head_dim, self.dtype,
                                           self.device) for i in range(self.arch.num_layers)]
        if window_layers:
            self.input_batch.enable_window_table()
            self.window_slot_mapping = StagedBuffer(self.slot_mapping.np.shape[0], torch.int64, self.device)
            self.window_step_block_table = StagedBuffer(self.step_block_table.np.shape, torch.int32, self.device)
            self.model.use_window_group(window_layers)
            if self.use_cuda_graphs:  # the captured graphs read one block table, not a second group's
                logger.warning("CUDA graphs off: the hybrid KV cache (a sliding-window group) runs eagerly")
                self.use_cuda_graphs = False
        if self._drafts_by_model:
            self.proposer.initialize_kv_cache(num_blocks)
        if self.use_cuda_graphs:
            buffers = SimpleNamespace(
                input_ids=self.input_ids, positions=self.positions, slot_mapping=self.slot_mapping,
                query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                block_table=self.step_block_table,
            )
            sizes = capture_sizes(self.input_batch.max_num_reqs)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, buffers, sizes)
            self.decode_graphs.capture()

    # ---- step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        encoder_seconds = self.encoder.update(so) if self.encoder is not None else 0.0
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], encoder_seconds=encoder_seconds)
        req_ids = list(so.num_scheduled_tokens)
        ib = self.input_batch
        rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        merges = []
        if self.encoder is not None and self.encoder.features:
            merges = self.encoder.merges(req_ids, ib.num_computed_tokens[rows], num_sched,
                                         np.cumsum(num_sched) - num_sched)
        num_drafts = self._write_drafts(so.scheduled_spec_decode_tokens, req_ids, rows)
        T, nb, sample_mask, n_logits = self._fill_host_inputs(rows, num_sched, num_drafts)
        graphs = self.decode_graphs
        out_rows = None  # a pooling step that reads some tokens computes only those (Pooler.output_rows)
        if (graphs is not None and not merges and T == len(rows)
                and padded_size(T, graphs.sizes) is not None):
            hidden = graphs.run(T)  # one token per request (so no drafts)
            # A 1-token chunk in the middle of a prompt does not sample.
            logits_indices = (
                slice(None) if n_logits == T
                else torch.from_numpy(np.flatnonzero(sample_mask)).to(self.device)
            )
        else:
            meta, input_ids, positions, logits_indices = self._to_device(len(rows), T, nb, n_logits, num_sched)
            embeds = self.encoder.embed(input_ids, merges) if merges else None
            if self.pooler is not None and self.pooler.params and self.lora is None:  # LoRA maps every token
                out_rows = self.pooler.output_rows(req_ids, ib.num_computed_tokens[rows], num_sched,
                                                   ib.num_prompt_tokens[rows], self.query_start_loc.np)
            kw = {} if out_rows is None else {"output_rows": torch.from_numpy(out_rows).to(self.device)}
            with self.lora.step(req_ids, num_sched) if self.lora is not None else nullcontext():
                hidden = self.model(input_ids, positions, self.kv_caches, meta, embeds, **kw)  # [T or N, hidden]
            if self._drafts_by_model:
                self.proposer.run_step(input_ids, positions, meta)
        prompt_lps = pooled = None
        if ib.prompt_logprob_reqs:
            prompt_lps = self._prompt_logprobs(hidden, req_ids, rows, num_sched)
        if self.pooler is not None and self.pooler.params:
            pooled = self.pooler.step(hidden, req_ids, ib.num_computed_tokens[rows], num_sched,
                                      ib.num_prompt_tokens[rows], self.query_start_loc.np, self.model.compute_logits,
                                      out_rows)
        ib.num_computed_tokens[rows] += num_sched
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprob_lists: list[list[dict[int, float]] | None] = [None] * len(req_ids)
        sample_idx = np.flatnonzero(sample_mask)
        if len(sample_idx):
            logits = self.model.compute_logits(hidden[logits_indices])  # [n_logits, vocab] on rank 0
            tokens, logprobs = self._sample(so, logits, req_ids, rows, sample_idx, num_drafts)
            for j, i in enumerate(sample_idx):
                row = int(rows[i])
                # Rejected drafts' KV is stale: the next step recomputes from the first of them.
                ib.num_computed_tokens[row] -= num_drafts[i] + 1 - len(tokens[j])
                for token in tokens[j]:
                    ib.append_token(row, token)
                sampled_lists[i] = tokens[j]
                if logprobs is not None:
                    logprob_lists[i] = logprobs[j]
        has_logprobs = any(lp is not None for lp in logprob_lists)
        return ModelRunnerOutput(req_ids, sampled_lists, logprob_lists if has_logprobs else None,
                                 encoder_seconds=encoder_seconds, spec_token_ids=self._propose(rows, sample_idx),
                                 prompt_logprobs=prompt_lps, pooler_output=pooled if self.tp.is_driver else None)

    def _prompt_logprobs(self, hidden: torch.Tensor, req_ids: list[str], rows: np.ndarray,
                         num_sched: np.ndarray) -> dict[str, list] | None:
        """Prompt logprobs of the positions this step computes (before progress advances)."""
        ib = self.input_batch
        spans = prompt_spans([ib.sampling_params[r] for r in rows], ib.num_tokens[rows], ib.num_prompt_tokens[rows],
                             ib.num_computed_tokens[rows], num_sched, self.query_start_loc.np)
        if not spans:
            return None
        scored = score_prompt(spans, hidden, self.model.compute_logits, ib.token_ids, rows, self.tp.is_driver)
        return {req_ids[i]: entries for i, entries in scored.items()} if self.tp.is_driver else None

    def _write_drafts(self, spec: dict[str, list[int]], req_ids: list[str], rows: np.ndarray) -> np.ndarray:
        """Put each request's drafts after its last token (inputs of the lookahead positions);
        returns [R] drafts per request. They sit past num_tokens, so appends overwrite them."""
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        if not spec:
            return num_drafts
        ib = self.input_batch
        for i, req_id in enumerate(req_ids):
            drafts = spec.get(req_id)
            if drafts:
                n = ib.num_tokens[rows[i]]
                ib.token_ids[rows[i], n:n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        return num_drafts

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray,
                sample_idx: np.ndarray, num_drafts: np.ndarray):
        """Tokens (and logprobs) per sampling request: one each, or with drafts the accepted
        run plus one. Every rank gets the tokens (its next inputs); logprobs only the driver."""
        per = num_drafts[sample_idx] + 1  # logits rows of each sampling request
        n_logits = int(per.sum())
        first = np.cumsum(per) - per
        pos_in_req = np.arange(n_logits) - np.repeat(first, per)
        speculating = n_logits > len(sample_idx)
        # Rank 0 fills the tokens, every rank receives them: one tensor per step. Without drafts
        # that is the sampler's own output; with drafts, each request's run padded with -1.
        flat = torch.empty(n_logits if speculating else len(sample_idx), dtype=torch.int64, device=self.device)
        logprobs = None
        if self.tp.is_driver:
            meta = sampling_metadata(self.input_batch, np.repeat(rows[sample_idx], per), pos_in_req,
                                     self.arch.vocab_size, self.device)
            if so.grammar_bitmask is not None:
                row_req_ids = [req_ids[i] for i, n in zip(sample_idx, per) for _ in range(n)]
                meta.grammar_bitmask, meta.grammar_rows = bitmask_for_sampled_rows(
                    so.structured_output_request_ids, so.grammar_bitmask, row_req_ids, self.device)
            if speculating:
                drafts = [so.scheduled_spec_decode_tokens.get(req_ids[i], []) for i in sample_idx]
                out = rejection_sample(logits, meta, drafts)
                logprobs = out.logprobs
                host = np.full(n_logits, -1, dtype=np.int64)
                for j, toks in enumerate(out.token_ids):
                    host[first[j]:first[j] + len(toks)] = toks
                flat = torch.from_numpy(host).to(self.device)
            else:
                out = self.sampler(logits, meta)
                flat = out.sampled_token_ids
                if out.logprobs is not None:
                    logprobs = [None if lp is None else [lp] for lp in out.logprobs]
        flat = self.tp.broadcast_from_driver(flat).tolist()
        if not speculating:
            return [[t] for t in flat], logprobs
        return [[t for t in flat[f:f + n] if t >= 0] for f, n in zip(first, per)], logprobs

    def _propose(self, rows: np.ndarray, sample_idx: np.ndarray) -> list[list[int]] | None:
        """Drafts for each request's next step (the driver's answer is the one that counts).
        Requests under a grammar do not speculate: a draft would need the matcher rolled back."""
        if self.proposer is None or not self.tp.is_driver:
            return None
        ib = self.input_batch
        out: list[list[int]] = [[] for _ in rows]
        eligible = [i for i in sample_idx if ib.sampling_params[rows[i]].structured_outputs is None]
        if not self._drafts_by_model:
            for i in eligible:
                row = int(rows[i])
                out[i] = self.proposer.propose(ib.token_ids[row, :ib.num_tokens[row]])
            return out
        if eligible:
            r = rows[eligible]
            last = ib.num_tokens[r] - 1
            # Draft inputs need KV slots: up to max_model_len and the lookahead reserved.
            limits = np.minimum(self.max_model_len, ib.block_table.num_blocks[r].astype(np.int64)
                                * self.kernel_block_size)
            for i, drafts in zip(eligible, self.proposer.propose(ib.block_table, r, ib.token_ids[r, last], last,
                                                                 limits)):
                out[i] = drafts
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        if self.lora is not None:
            self.lora.update(so)
        for req_id in so.finished_req_ids:
            ib.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            # Keep the RNG: a resumed seeded request continues its random stream.
            ib.remove_request(req_id, keep_generator=True)
        if self.pooler is not None:
            self.pooler.update(so)
        for new in so.scheduled_new_reqs:
            ib.add_request(
                new.req_id,
                new.token_ids,
                len(new.prompt_token_ids),
                new.num_computed_tokens,
                new.block_ids,
                new.sampling_params,
                self.device,
                rng_draws_done=new.kv_transfer_params.num_prior_output_tokens if new.kv_transfer_params else 0,
                vocab_size=self.arch.vocab_size,
                window_block_ids=new.window_block_ids,
            )
        cached = so.scheduled_cached_reqs
        if ib.window_block_table is not None:
            for req_id, block_ids in zip(cached.req_ids, cached.new_window_block_ids):
                ib.window_block_table.append_row(ib.req_id_to_row[req_id], block_ids)
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = ib.req_id_to_row[req_id]
            ib.block_table.append_row(row, block_ids)
            ib.num_computed_tokens[row] = num_computed

    def _fill_host_inputs(self, rows: np.ndarray, num_sched: np.ndarray, num_drafts: np.ndarray):
        """Write this step's flattened inputs into the host buffers; returns
        (num tokens, block-table width, which rows sample, how many logits rows)."""
        ib = self.input_batch
        R = len(rows)
        T = int(num_sched.sum())
        cu = self.query_start_loc.np[: R + 1]
        cu[0] = 0
        np.cumsum(num_sched, out=cu[1:])
        starts = ib.num_computed_tokens[rows]
        req_idx = np.repeat(np.arange(R), num_sched)  # [T] request of each token
        positions = starts[req_idx] + np.arange(T) - cu[:-1][req_idx]
        token_rows = rows[req_idx]
        self.positions.np[:T] = positions
        self.input_ids.np[:T] = ib.token_ids[token_rows, positions]
        self.slot_mapping.np[:T] = ib.block_table.compute_slot_mapping(token_rows, positions)
        seq_lens = starts + num_sched
        self.seq_lens.np[:R] = seq_lens
        nb = -(-int(seq_lens.max()) // self.kernel_block_size)
        self.step_block_table.np[:R, :nb] = ib.block_table.table.np[rows, :nb]
        if ib.window_block_table is not None:
            self.window_slot_mapping.np[:T] = ib.window_block_table.compute_slot_mapping(token_rows, positions)
            self.window_step_block_table.np[:R, :nb] = ib.window_block_table.table.np[rows, :nb]
        # Sample only where the step reaches the end of the known tokens (not mid-prompt).
        sample_mask = seq_lens >= ib.num_tokens[rows]
        if self.pooler is not None and self.pooler.params:
            sample_mask &= ~self.pooler.mask([ib.req_ids[r] for r in rows])  # pooling never samples
        # A verifying request needs logits at its last 1 + drafts positions, one per draft
        # and one for the token after them all.
        per = np.where(sample_mask, num_drafts + 1, 0)
        n_logits = int(per.sum())
        first = np.cumsum(per) - per
        self.logits_indices.np[:n_logits] = (np.repeat(cu[1:] - per, per)
                                             + np.arange(n_logits) - np.repeat(first, per))
        return T, nb, sample_mask, n_logits

    def _to_device(self, R: int, T: int, nb: int, n_sample: int, num_sched: np.ndarray):
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.to_device(T),
            block_table=self.step_block_table.to_device(R)[:, :nb],  # only the R rows in use
            query_start_loc=self.query_start_loc.to_device(R + 1),
            seq_lens=self.seq_lens.to_device(R),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(self.seq_lens.np[:R].max()),
        )
        if self.window_slot_mapping is not None:
            meta.window_group = AttentionMetadata(
                slot_mapping=self.window_slot_mapping.to_device(T),
                block_table=self.window_step_block_table.to_device(R)[:, :nb],
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        return meta, self.input_ids.to_device(T), self.positions.to_device(T), self.logits_indices.to_device(n_sample)

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """The model on no tokens: an idle data-parallel core's step (engine.worker.dry_runs)."""
        dummy_forward(self.model, self.kv_caches, self.device)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward pass of `num_tokens` prompt tokens against a throwaway KV cache, to
        measure peak activation memory (engine.worker.dry_runs)."""
        profile_forward(self.model, num_tokens, self.kernel_block_size, self.num_kv_heads, self.dtype,
                        self.device, self.max_model_len, self.input_batch.max_num_reqs)
