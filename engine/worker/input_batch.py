"""The persistent batch: per-request state kept in preallocated rows across steps.

Requests that stay scheduled are not rebuilt each step; only new, resumed, finished and
preempted requests touch it. Rows are kept dense (a removed row is filled by the last one).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.worker.block_table import BlockTable


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        kernel_block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str] = []
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Where the generated tokens start: the prompt's end, less the tokens a P/D prefill
        # generated, which the decode side receives as part of its prompt (penalties count them).
        self.output_start = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(
            max_num_reqs, -(-max_model_len // block_size), block_size, kernel_block_size, device
        )
        # A hybrid model's sliding-window group has its own table (enable_window_table).
        self.window_block_table: BlockTable | None = None
        self._table_args = (max_num_reqs, -(-max_model_len // block_size), block_size, kernel_block_size, device)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        # Per-request RNG for seeded requests, so their tokens do not depend on the batch.
        self.generators: dict[str, torch.Generator] = {}
        # Requests that asked for prompt logprobs (a step without any skips looking for them).
        self.prompt_logprob_reqs: set[str] = set()

    def enable_window_table(self) -> None:
        self.window_block_table = BlockTable(*self._table_args)

    @property
    def block_tables(self) -> list[BlockTable]:
        return [self.block_table] + ([self.window_block_table] if self.window_block_table is not None else [])

    def __len__(self) -> int:
        return len(self.req_ids)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        block_ids: list[int],
        params: SamplingParams,
        device: torch.device,
        rng_draws_done: int = 0,  # output tokens sampled elsewhere (P/D: the prefill's)
        vocab_size: int = 0,
        window_block_ids: list[int] | None = None,
    ) -> None:
        if req_id in self.req_id_to_row:
            self.remove_request(req_id)
        if len(self.req_ids) >= self.max_num_reqs:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")
        row = len(self.req_ids)
        self.req_ids.append(req_id)
        self.req_id_to_row[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.output_start[row] = num_prompt_tokens - rng_draws_done
        self.block_table.add_row(row, block_ids)
        if self.window_block_table is not None:
            self.window_block_table.add_row(row, window_block_ids or [])
        self.sampling_params[row] = params
        if params.prompt_logprobs is not None:
            self.prompt_logprob_reqs.add(req_id)
        if params.seed is not None and req_id not in self.generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
            if not params.greedy:
                # Replay the sampler's per-token draw (one Exp(1) per vocab entry) for tokens
                # sampled elsewhere, so the stream continues where it left off.
                for _ in range(rng_draws_done):
                    torch.empty(vocab_size, device=device).exponential_(generator=gen)
            self.generators[req_id] = gen

    def remove_request(self, req_id: str, keep_generator: bool = False) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        if not keep_generator:
            self.generators.pop(req_id, None)
        self.prompt_logprob_reqs.discard(req_id)
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_row[moved] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.output_start):
                arr[row] = arr[last]
            for table in self.block_tables:
                table.move_row(last, row)
            self.sampling_params[row] = self.sampling_params[last]
        self.req_ids.pop()
        self.sampling_params[last] = None

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
