"""One decoder-only transformer for the Llama family: Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2/3 (GeGLU, sandwich norms, soft-capping, sliding-window layers), and the MoE families
built on them (Mixtral, Qwen3-MoE), whose layers swap the MLP for routed experts.

Our own layers with fused qkv and gate_up projections; attention runs through the paged
kernel contract, so a layer reads and writes its KV in the paged cache. Under tensor
parallelism (engine.models.parallel) each rank builds the same modules at its shard's sizes;
under expert parallelism each MoE layer holds this rank's experts (engine.models.moe).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.models.arch import ModelArch
from engine.models.attention_metadata import AttentionMetadata
from engine.models.cpu_linear import pack_model_linears, pack_weight, packed_linear
from engine.models.fused_decode import accepts as stack_accepts
from engine.models.fused_decode import build as build_stack
from engine.models.moe import SparseMoE
from engine.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    parallel_logits,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: SimpleNamespace) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, layout: ShardLayout, ops: SimpleNamespace, tp: TPGroup, index: int = 0) -> None:
        super().__init__()
        arch = layout.arch
        # This rank's heads (all of them on one rank).
        self.h, self.hkv, self.d = layout.num_heads, layout.num_kv_heads, arch.head_dim
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=arch.qkv_bias)
        self.o_proj = RowParallelLinear(self.h * self.d, arch.hidden_size, arch.o_bias, tp)
        self.q_norm = RMSNorm(self.d, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.d, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.scale = arch.attn_scale
        # Only what a layer uses reaches the kernel, so plain layers keep its plain signature.
        self.extra = {k: v for k, v in (("sliding_window", arch.window(index)), ("softcap", arch.attn_softcap)) if v}
        self.ops = ops
        self.in_window_group = False  # set by CausalLM.use_window_group

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata, cos_sin,
                rows: torch.Tensor | None = None, rows_meta: AttentionMetadata | None = None):
        """Every token's K/V is cached; with `rows` (and their `rows_meta`,
        AttentionMetadata.for_queries) only those tokens' outputs are computed: [N, hidden]."""
        if self.in_window_group and meta.window_group is not None:
            meta = meta.window_group
            rows_meta = None if rows_meta is None else rows_meta.window_group
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.view(T, self.h, self.d)  # [T, H, D]
        k = k.view(T, self.hkv, self.d)  # [T, Hkv, D]
        v = v.view(T, self.hkv, self.d)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin, True)
        key_cache, value_cache = kv_cache
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if rows is not None:
            q, meta, T = q[rows], rows_meta, rows.shape[0]
        o = self.ops.paged_attention(
            q, key_cache, value_cache, meta.block_table, meta.query_start_loc, meta.seq_lens, self.scale,
            **self.extra,
        )
        return self.o_proj(o.reshape(T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, layout: ShardLayout, ops: SimpleNamespace, tp: TPGroup) -> None:
        super().__init__()
        arch, inter = layout.arch, layout.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, 2 * inter, bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, tp)
        self.act_and_mul = ops.gelu_tanh_and_mul if arch.hidden_act == "gelu_tanh" else ops.silu_and_mul

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, layout: ShardLayout, ops: SimpleNamespace, tp: TPGroup, index: int = 0,
                 ep: EPGroup = SINGLE_EP) -> None:
        super().__init__()
        arch = layout.arch
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(layout, ops, tp, index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = SparseMoE(layout, ops, tp, ep) if arch.is_moe_layer(index) else MLP(layout, ops, tp)
        # Gemma's sandwich: post_attention_layernorm normalises the attention output before the
        # residual add, and the MLP gets its own pre and post norms.
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        # Gemma 3's window layers rotate with their own base (CausalLM.cos_sin_local).
        self.local_rope = arch.window(index) > 0 and arch.local_rope_theta is not None

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin, rows=None, rows_meta=None):
        # The residual add is fused into the norms: rms_norm(x, w, eps, residual) returns
        # (norm(x + residual), x + residual).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        rope = cos_sin[1] if self.local_rope else cos_sin[0]
        x = self.self_attn(positions, x, kv_cache, meta, rope, rows, rows_meta)
        if rows is not None:  # past attention every op is per token: only `rows` go on
            residual = residual[rows]
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch, ops: SimpleNamespace, max_positions: int,
                 tp: TPGroup = SINGLE_RANK, ep: EPGroup = SINGLE_EP) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.layout = layout = ShardLayout(arch, tp.rank, tp.size, ep.rank, ep.size)
        self.embed_tokens = VocabParallelEmbedding(layout, arch.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(layout, ops, tp, i, ep) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        # The LM head splits the vocabulary like the embedding (same rows when tied).
        self.lm_head = (None if arch.tie_word_embeddings
                        else ColumnParallelLinear(arch.hidden_size, self.embed_tokens.num_embeddings, bias=False))
        # Tied embeddings on CPU: a oneDNN-packed copy of the table for the logits (the
        # embedding lookup keeps the dense one).
        self.tied_head: torch.Tensor | None = None
        # fp32 rope table, kept out of the state dict (it is derived, not loaded). The model is
        # built on the meta device, where computing it is wasted (and runs torch's Python
        # reference ops): the loader fills it (cos_sin_cache) once the model is real.
        self.register_buffer("cos_sin", torch.empty(max_positions, arch.rotary_dim, dtype=torch.float32),
                             persistent=False)
        # Short-query steps as one C call over GGUF blocks (engine.models.fused_decode): None
        # until the first step builds it, False where the model does not fit it.
        self._stack = None
        self.register_buffer("cos_sin_local", None if arch.local_rope_theta is None else torch.empty(
            max_positions, arch.rotary_dim, dtype=torch.float32), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: multimodal steps embed first
        output_rows: torch.Tensor | None = None,  # [N] int64 ascending: only these tokens' states
    ) -> torch.Tensor:  # hidden states [T, hidden], or [N, hidden] of output_rows
        """With `output_rows` (a pooling step that reads a few tokens: the last, the first)
        the last layer computes the rest of its tokens' K/V only: their attention outputs,
        MLP and final norm would feed nothing. Earlier layers still run every token, since
        the next layer's keys and values are computed from them."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.arch.embed_scale != 1.0 and inputs_embeds is None:
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)  # rounded as transformers does
        if self._stack is None:  # first step: the weights are loaded by now
            self._stack = build_stack(self) or False
        if self._stack and stack_accepts(x, meta):
            x = x if x.is_contiguous() else x.contiguous()
            x = self._stack(x, positions, meta.slot_mapping, meta.block_table, meta.query_start_loc,
                            meta.seq_lens, kv_caches)
            return x if output_rows is None else x[output_rows]
        residual = None
        cos_sin = (self.cos_sin, self.cos_sin_local)
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i == last and output_rows is not None:
                rows_meta = meta.for_queries(output_rows, positions)
                x, residual = layer(positions, x, residual, kv, meta, cos_sin, output_rows,
                                    rows_meta)
            else:
                x, residual = layer(positions, x, residual, kv, meta, cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def use_window_group(self, layers: set[int]) -> None:
        """These layers' KV lives in the hybrid cache's window group (its own block table)."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.in_window_group = i in layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab] fp32 logits; under tensor parallelism on rank 0 only (None elsewhere)."""
        if self.lm_head is not None:
            local = self.lm_head.linear(hidden)
        elif self.tied_head is not None:
            local = packed_linear(hidden, self.tied_head, None)
        elif self.embed_tokens.quant is not None:
            local = self.embed_tokens.quant.matmul(hidden)  # the tied head: GGUF blocks or 16-bit rows
        else:
            local = nn.functional.linear(hidden, self.embed_tokens.weight)
        logits = parallel_logits(local, self.arch.vocab_size, self.tp)
        cap = self.arch.final_softcap
        if cap and logits is not None:
            logits = torch.tanh(logits.div_(cap)).mul_(cap)  # Gemma 2's final_logit_softcapping
        return logits

    def pack_cpu_weights(self) -> int:
        """Pack the projections and the logits head for oneDNN (engine.models.cpu_linear);
        returns how many weights were packed (none where it does not apply)."""
        n = pack_model_linears(self)
        if self.lm_head is None and self.embed_tokens.quant is None:
            self.tied_head = pack_weight(self.embed_tokens.weight)
            n += self.tied_head is not None
        return n
