"""How a model's sliding-window layers share the KV cache (vLLM's hybrid allocator, our
design; docs/engine.md#sliding-window-attention).

A window layer at position p reads keys (p - W, p] only, so a request's blocks wholly before
its next query's window can be freed. Layers split into KV cache groups by what they can free:
  - no window layer: one group, nothing freed (every model before Gemma);
  - every layer windowed (Mistral-style `sliding_window`): one group that frees;
  - a mix (Gemma 2 / 3, Qwen2 with max_window_layers): a main group of full-attention layers
    and a window group with a pool, KV tensors and block table of its own, holding about
    W / block_size + 2 blocks per running request instead of one per block of context.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.arch import ModelArch


@dataclass(frozen=True)
class KVGroups:
    main_window: int = 0  # > 0: the one group frees out-of-window blocks (all layers slide)
    window: int = 0  # > 0: a second group holds the window layers
    num_window_layers: int = 0

    @property
    def hybrid(self) -> bool:
        return self.window > 0


def kv_groups(arch: ModelArch, *, disabled: bool, draft_model: bool) -> KVGroups:
    """The grouping for `arch`. Windows stay masks and every block is kept (KVGroups()) when
    the user disabled it, or when a draft model shares the block ids (its KV is sized per
    main block, and it attends to the whole context). Layers with different windows share the
    largest."""
    if disabled or not arch.has_windows:
        return KVGroups()
    window = max(arch.layer_windows)
    num_window = sum(1 for w in arch.layer_windows if w)
    if draft_model:
        return KVGroups()
    if num_window == arch.num_layers:
        return KVGroups(main_window=window)
    return KVGroups(window=window, num_window_layers=num_window)


def window_blocks_bound(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                        num_lookahead: int = 0) -> int:
    """Window-group blocks enough for max_num_seqs running requests: each holds the blocks of
    its window plus the one being written (+1 where the window straddles a boundary) and its
    lookahead; one step's chunk adds at most max_num_batched_tokens; plus the null block."""
    per_request = -(-(window - 1 + num_lookahead) // block_size) + 2
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size) + 1


def split_blocks(main_blocks: int | None, memory_bytes: int | None, main_bytes: int, window_bytes: int,
                 bound: int) -> tuple[int, int]:
    """(main, window) block counts. Given the main count (num_kv_blocks), the window group
    gets as many, up to `bound`, plus its null block: a request's in-use window blocks never
    outnumber its main ones. Given memory, it is shared so that the main group gets what the
    window group, capped at `bound`, leaves."""
    if main_blocks is not None:
        return main_blocks, min(main_blocks, bound) + 1
    assert memory_bytes is not None
    even = max(0, memory_bytes - window_bytes) // (main_bytes + window_bytes)
    if even <= bound:
        return even, even + 1
    return (memory_bytes - (bound + 1) * window_bytes) // main_bytes, bound + 1
