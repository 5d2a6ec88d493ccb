"""Tensor-parallel layers and the shard layout of one rank (Megatron-style split, our code).

Column-parallel layers (fused QKV, fused gate/up) keep a slice of the output features, so each
rank computes its own heads and its own part of the MLP with no communication; row-parallel
layers (o_proj, down_proj) take that slice as input and all-reduce their partial sums. The
embedding and the LM head split the vocabulary.

With one rank every layer is the plain torch layer it was before: same parameter shapes,
names and arithmetic, and no collective call.

Under expert parallelism the experts of every MoE layer are partitioned whole over the expert-
parallel ranks (data parallel x tensor parallel); attention and dense layers keep their TP split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import TPGroup
from engine.errors import ParameterError
from engine.models.arch import ModelArch
from engine.models.cpu_linear import PackedLinearMixin


def check_tp_size(arch: ModelArch, tp: int, expert_parallel: bool = False) -> None:
    """Raise ParameterError unless `arch` splits evenly over `tp` ranks. Under expert
    parallelism the experts are not TP-sharded, so their intermediate size need not split."""
    field = "tensor_parallel_size"
    if arch.num_experts and not expert_parallel and arch.moe_intermediate_size % tp:
        raise ParameterError(
            field, f"{field}={tp} must divide the experts' intermediate size {arch.moe_intermediate_size}")
    if arch.num_heads % tp:
        raise ParameterError(field, f"{field}={tp} must divide num_attention_heads={arch.num_heads}")
    hkv = arch.num_kv_heads
    if hkv % tp and tp % hkv:
        raise ParameterError(
            field, f"{field}={tp} must divide num_key_value_heads={hkv} or be a multiple of it "
            "(fewer kv heads than ranks are replicated)")
    if arch.intermediate_size % tp:
        raise ParameterError(field, f"{field}={tp} must divide intermediate_size={arch.intermediate_size}")


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` of `size` holds: an even split when there are at least as many
    heads as ranks, else head rank * num_kv_heads // size, replicated on consecutive ranks (the
    ranks whose query heads read it). P/D re-sharding (kvstore.reshard) reads the same rule."""
    start = rank * num_kv_heads // size
    return range(start, start + max(1, num_kv_heads // size))


def check_ep_size(arch: ModelArch, ep_size: int) -> None:
    """Raise ParameterError unless `arch` has experts that split whole over `ep_size` ranks
    (under enable_expert_parallel, ep_size = data_parallel_size x tensor_parallel_size)."""
    field = "enable_expert_parallel"
    if ep_size < 1:
        raise ParameterError(field, f"expert-parallel size must be >= 1, got {ep_size}")
    if ep_size == 1:
        return
    if not arch.num_experts:
        raise ParameterError(field, "expert parallelism needs a mixture-of-experts model (Qwen3-MoE, "
                             f"Mixtral); {arch.architecture} has no experts")
    E = arch.num_experts
    if E % ep_size:
        allowed = [d for d in range(1, E + 1) if E % d == 0]
        raise ParameterError(
            field, f"{field} splits the {E} experts over data_parallel_size x tensor_parallel_size = "
            f"{ep_size} ranks, which must divide {E} (allowed products: {allowed})")


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds. KV heads are split when there are at least as many
    as ranks, otherwise each is replicated on size / num_kv_heads consecutive ranks (the ranks
    whose query heads read it). `ep_rank` of `ep_size` is the rank's place among the
    expert-parallel ranks (size 1: no expert parallelism)."""

    arch: ModelArch
    rank: int = 0
    size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        # Users' sizes are checked with their field names first (check_tp_size, check_ep_size).
        if not (0 <= self.rank < self.size and 0 <= self.ep_rank < self.ep_size):
            raise ValueError(f"rank {self.rank} of {self.size} / expert rank {self.ep_rank} of {self.ep_size}")
        if self.ep_size > 1 and self.arch.num_experts % self.ep_size:
            raise ValueError(f"{self.arch.num_experts} experts do not split over {self.ep_size} ranks")

    @property
    def num_heads(self) -> int:
        return self.arch.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return len(kv_head_range(self.rank, self.size, self.arch.num_kv_heads))

    @property
    def kv_head_start(self) -> int:
        return kv_head_range(self.rank, self.size, self.arch.num_kv_heads).start

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's intermediate slice on this rank: without expert parallelism experts
        are split like the dense MLP (every rank holds every expert, a 1/size slice of each);
        with it, each rank holds its experts whole."""
        if self.ep_size > 1:
            return self.arch.moe_intermediate_size
        return self.arch.moe_intermediate_size // self.size

    @property
    def num_local_experts(self) -> int:
        return self.arch.num_experts // self.ep_size

    @property
    def expert_start(self) -> int:
        """This rank holds experts [expert_start, expert_start + num_local_experts)."""
        return self.ep_rank * self.num_local_experts

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding on every rank; the last rank's tail past the vocabulary is
        padding (zero rows, logits dropped after the gather)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (not padding) vocabulary rows on this rank."""
        return max(0, min(self.vocab_per_rank, self.arch.vocab_size - self.vocab_start))


class ColumnParallelLinear(PackedLinearMixin, nn.Linear):
    """y[:, local outputs] = x @ W_local^T + b_local. The caller sizes `out_features` for one
    rank (fused QKV or gate/up: the local slice of each part, concatenated). On CPU the
    weight may be packed for oneDNN (engine.models.cpu_linear)."""

    lora = None  # engine.lora.layers.LoRAStack once adapters are enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.bias)
        return y if self.lora is None else self.lora.add_delta(x, y)


class RowParallelLinear(PackedLinearMixin, nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: each rank holds the input-feature columns
    that match its column-parallel producer; the bias (replicated) is added once, after the
    sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    lora = None  # engine.lora.layers.LoRAStack (one rank: LoRA refuses tensor parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            y = self.linear(x, self.bias)
            return y if self.lora is None else self.lora.add_delta(x, y)
        y = self.tp.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds rows [vocab_start, vocab_start + vocab_per_rank); a token outside them
    embeds to zeros here and the all-reduce takes the owning rank's row."""

    def __init__(self, layout: ShardLayout, hidden_size: int, tp: TPGroup) -> None:
        rows = layout.vocab_per_rank if tp.size > 1 else layout.arch.vocab_size
        # An explicit (uninitialised) weight skips nn.Embedding's normal_() init: the loader
        # fills every row, and normal_ on the meta device runs torch's Python reference ops.
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.tp = tp
        self.vocab_start = layout.vocab_start

    # QuantWeight (the table kept in GGUF blocks) or HalfWeight (in its checkpoint's 16 bits),
    # set by the loader.
    quant = None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(ids).reshape(*ids.shape, self.embedding_dim)
        return nn.functional.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)  # [T]
        x = self.lookup(local.masked_fill(~mine, 0))  # [T, hidden]
        return self.tp.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0.0))


def parallel_logits(local_logits: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor | None:
    """This rank's logits [N, vocab / tp] (hidden @ its vocab rows) -> full fp32 logits
    [N, vocab] on rank 0 (None on the others), gathered so rank 0 samples over the whole
    vocabulary."""
    logits = local_logits.float()
    if tp.size == 1:
        return logits
    full = tp.gather_to_driver(logits)
    return None if full is None else full[:, :vocab_size]
