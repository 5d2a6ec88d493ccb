"""CUDA graphs for decode steps.

A decode-only step of n requests is padded up to the nearest captured size and replayed.
Padding rows are 1-token requests with slot -1 (their K/V is never written), position 0,
context length 1 and block-table row of zeros, so they read valid memory and their outputs
are dropped. The graphs read the runner's persistent device buffers, whose addresses never
change, so a replay only needs those buffers filled.

Size selection and padding are plain functions over numpy arrays, tested on CPU.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from engine.models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, 256), always including it."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(sizes)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n, or None when n is larger than every size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_decode_inputs(
    n: int,
    size: int,
    input_ids: np.ndarray,  # [>= size]
    positions: np.ndarray,  # [>= size]
    slot_mapping: np.ndarray,  # [>= size]
    query_start_loc: np.ndarray,  # [>= size + 1]
    seq_lens: np.ndarray,  # [>= size]
    block_table: np.ndarray,  # [>= size, max_blocks]
) -> None:
    """Fill rows [n, size) of the (host) input buffers in place as harmless padding."""
    input_ids[n:size] = 0
    positions[n:size] = 0
    slot_mapping[n:size] = -1
    query_start_loc[: size + 1] = np.arange(size + 1)
    seq_lens[n:size] = 1
    block_table[n:size] = 0


class DecodeGraphs:
    """Captured decode forwards, one per size, sharing one memory pool."""

    def __init__(self, model, kv_caches, buffers, sizes: list[int]) -> None:
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._model = model
        self._kv_caches = kv_caches
        self._b = buffers  # SimpleNamespace of the runner's StagedBuffers

    def _metadata(self, size: int) -> AttentionMetadata:
        b = self._b
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.device_tensor[:size],
            block_table=b.block_table.device_tensor[:size],
            query_start_loc=b.query_start_loc.device_tensor[: size + 1],
            seq_lens=b.seq_lens.device_tensor[:size],
            max_query_len=1,
            max_seq_len=0,  # not read by the Triton kernels
        )

    @torch.inference_mode()
    def capture(self) -> None:
        b = self._b
        pool = None
        for size in sorted(self.sizes, reverse=True):
            pad_decode_inputs(0, size, b.input_ids.np, b.positions.np, b.slot_mapping.np,
                              b.query_start_loc.np, b.seq_lens.np, b.block_table.np)
            for buf in (b.input_ids, b.positions, b.slot_mapping, b.query_start_loc, b.seq_lens, b.block_table):
                buf.to_device()
            ids, pos = b.input_ids.device_tensor[:size], b.positions.device_tensor[:size]
            meta = self._metadata(size)
            self._model(ids, pos, self._kv_caches, meta)  # warm-up: compile kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._model(ids, pos, self._kv_caches, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def run(self, n: int) -> torch.Tensor:
        """Replay for n real requests whose inputs are already in the host buffers' first n
        rows; returns their hidden states [n, hidden]."""
        size = padded_size(n, self.sizes)
        assert size is not None
        b = self._b
        pad_decode_inputs(n, size, b.input_ids.np, b.positions.np, b.slot_mapping.np,
                          b.query_start_loc.np, b.seq_lens.np, b.block_table.np)
        b.input_ids.to_device(size)
        b.positions.to_device(size)
        b.slot_mapping.to_device(size)
        b.query_start_loc.to_device(size + 1)
        b.seq_lens.to_device(size)
        b.block_table.to_device(size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
