"""Torch references for every kernel in the contract (docs/architecture.md#kernels).

They are the specification the Triton kernels are tested against, and the implementation the
engine runs on CPU. Each is written for clarity first, vectorised where the CPU path needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding (skip)
) -> None:
    """Write each token's K/V into its paged slot (slot = block * block_size + offset)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_blocks, block_size = key_cache.shape[:2]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slot_mapping] = value.to(
        value_cache.dtype
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] flattened super-sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32, context length including this step's tokens
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    Query i of a request with q_len new tokens sits at position p = seq_len - q_len + i and
    sees keys [0, p]. KV heads are shared by groups of H // Hkv query heads (GQA/MQA).

    sliding_window W > 0: it sees only keys (p - W, p], W keys including itself. softcap
    c > 0: each score s = (q . k) * scale becomes c * tanh(s / c) before masking and softmax
    (Gemma 2). Blocks wholly before the window of a request's first query are never read,
    so their table entries may point anywhere (the engine frees them).

    Single-token (decode) requests are batched into one call; multi-token (prefill) requests
    run one by one so that no FLOPs go to padding and a full prefill uses causal SDPA.
    """
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    ctx = seq_lens.tolist()
    if sliding_window > 0 or softcap > 0:
        rows = [r for r in range(len(ctx)) if starts[r + 1] > starts[r]]
        windowed_attention(q, key_cache, value_cache, block_table, starts, ctx, rows, scale, out,
                           sliding_window, softcap)
        return out
    decode_rows = [r for r in range(len(ctx)) if starts[r + 1] - starts[r] == 1]
    if decode_rows:
        _decode_attention(q, key_cache, value_cache, block_table, starts, ctx, decode_rows, scale, out)
    multi_token_rows = [r for r in range(len(ctx)) if starts[r + 1] - starts[r] > 1]
    prefill_attention(q, key_cache, value_cache, block_table, starts, ctx, multi_token_rows, scale, out)
    return out


def prefill_attention(q, key_cache, value_cache, block_table, starts: list[int], ctx: list[int],
                      rows: list[int], scale: float, out: torch.Tensor, sliding_window: int = 0,
                      softcap: float = 0.0) -> None:
    """paged_attention for `rows` (each with more than one query token), one request at a
    time: causal SDPA over its gathered context, written into `out`."""
    if sliding_window > 0 or softcap > 0:
        windowed_attention(q, key_cache, value_cache, block_table, starts, ctx, rows, scale, out,
                           sliding_window, softcap)
        return
    for r in rows:
        q_len = starts[r + 1] - starts[r]
        k, v = gather_context(key_cache, value_cache, block_table[r : r + 1], ctx[r])  # [1, Hkv, L, D]
        qr = q[starts[r] : starts[r + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if q_len == ctx[r]:
            o = F.scaled_dot_product_attention(
                qr.float(), k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        else:  # a chunk over a cached prefix: causal, aligned to the end of the context
            mask = torch.ones(q_len, ctx[r], dtype=torch.bool, device=key_cache.device).tril(ctx[r] - q_len)
            o = F.scaled_dot_product_attention(
                qr.float(), k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1).to(out.dtype)


def gather_context(key_cache, value_cache, block_table, max_len):
    """Dense fp32 K/V [R, Hkv, max_len, D] of each table row's first max_len positions.
    (index_select over flat block ids is much faster on CPU than advanced indexing.)"""
    R = block_table.shape[0]
    block_size, Hkv, D = key_cache.shape[1:]
    nb = -(-max_len // block_size)
    ids = block_table[:, :nb].reshape(-1).long()
    k = key_cache.index_select(0, ids).view(R, nb * block_size, Hkv, D)[:, :max_len]
    v = value_cache.index_select(0, ids).view(R, nb * block_size, Hkv, D)[:, :max_len]
    return k.transpose(1, 2).float(), v.transpose(1, 2).float()


def _decode_attention(q, key_cache, value_cache, block_table, starts, ctx, rows, scale, out):
    dev = key_cache.device  # the index and mask tensors live beside the cache (CUDA in GPU tests)
    for bucket in _length_buckets(sorted(rows, key=lambda r: ctx[r]), ctx, key_cache[0, 0].numel()):
        lens = torch.tensor([ctx[r] for r in bucket], device=dev)
        k, v = gather_context(key_cache, value_cache, block_table[torch.tensor(bucket, device=block_table.device)],
                               ctx[bucket[-1]])
        tok = torch.tensor([starts[r] for r in bucket], device=q.device)
        qd = q[tok].unsqueeze(2).float()  # [n, H, 1, D]
        mask = torch.arange(k.shape[2], device=dev).view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1)
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        out[tok] = o.squeeze(2).to(out.dtype)


# Queries per step of a windowed/softcapped prefill: bounds its scores to CHUNK x (CHUNK + W).
_QUERY_CHUNK = 256


def windowed_attention(q, key_cache, value_cache, block_table, starts: list[int], ctx: list[int],
                       rows: list[int], scale: float, out: torch.Tensor, window: int,
                       softcap: float) -> None:
    """paged_attention for `rows` with a sliding window and/or a logit softcap: decodes batched
    in buckets of similar span, prefills in chunks of queries, each over only the keys it can
    see, gathered from the first block that holds one of them."""
    dev = key_cache.device
    decode = [r for r in rows if starts[r + 1] - starts[r] == 1]
    span = {r: min(ctx[r], window) if window > 0 else ctx[r] for r in decode}
    buckets = _length_buckets(sorted(decode, key=span.get), span, key_cache[0, 0].numel()) if decode else []
    for bucket in buckets:
        tok = torch.tensor([starts[r] for r in bucket], device=dev)
        qpos = torch.tensor([[ctx[r] - 1] for r in bucket], device=dev)
        o = _attend(q[tok].unsqueeze(2), key_cache, value_cache,
                    block_table[torch.tensor(bucket, device=block_table.device)], qpos, scale, window, softcap)
        out[tok] = o.squeeze(2).to(out.dtype)
    for r in rows:
        q_len = starts[r + 1] - starts[r]
        if q_len == 1:
            continue
        for i0 in range(0, q_len, _QUERY_CHUNK):
            i1 = min(i0 + _QUERY_CHUNK, q_len)
            qr = q[starts[r] + i0 : starts[r] + i1].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            qpos = torch.arange(ctx[r] - q_len + i0, ctx[r] - q_len + i1, device=dev).unsqueeze(0)
            o = _attend(qr, key_cache, value_cache, block_table[r : r + 1], qpos, scale, window, softcap)
            out[starts[r] + i0 : starts[r] + i1] = o[0].transpose(0, 1).to(out.dtype)


def _attend(qb, key_cache, value_cache, table, qpos, scale: float, window: int, softcap: float):
    """Attention of queries qb [R, H, n, D] at ascending positions qpos [R, n], each row over
    the blocks of its table row [R, max_blocks] -> fp32 [R, H, n, D]."""
    R, H, n, D = qb.shape
    block_size, Hkv = key_cache.shape[1:3]
    dev = qpos.device
    lo = (qpos[:, 0] - window + 1).clamp(min=0) if window > 0 else torch.zeros(R, dtype=torch.long, device=dev)
    hi = qpos[:, -1] + 1
    first = lo // block_size
    nb = int((-(-hi // block_size) - first).max())
    # Shorter rows of a bucket run past their own blocks: clamped to the table, zeroed below.
    blocks = (first[:, None] + torch.arange(nb, device=dev)).clamp(max=table.shape[1] - 1)
    ids = table.to(dev).long().gather(1, blocks).reshape(-1)
    pos = first[:, None] * block_size + torch.arange(nb * block_size, device=dev)  # [R, L]
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    kv = []
    for cache in (key_cache, value_cache):
        x = cache.index_select(0, ids).view(R, nb * block_size, Hkv, D).float()
        # Masked keys still meet the softmax as 0 * value: NaN in a stale or unwritten slot
        # would leak through, so they are zeroed.
        kv.append(x.masked_fill_(~inside[:, :, None, None], 0.0).transpose(1, 2))  # [R, Hkv, L, D]
    k, v = kv
    mask = inside[:, None, :] & (pos[:, None, :] <= qpos[:, :, None])  # [R, n, L]
    if window > 0:
        mask &= pos[:, None, :] > qpos[:, :, None] - window
    if softcap <= 0:
        return F.scaled_dot_product_attention(qb.float(), k, v, attn_mask=mask[:, None], scale=scale,
                                              enable_gqa=Hkv != H)
    # SDPA has no softcap: scores in fp32, grouped so GQA needs no repeated K/V.
    G = H // Hkv
    s = torch.matmul(qb.float().reshape(R, Hkv, G, n, D), k.unsqueeze(2).transpose(-1, -2)) * scale
    s = torch.tanh(s.div_(softcap)).mul_(softcap).masked_fill_(~mask[:, None, None], float("-inf"))
    return torch.matmul(s.softmax(-1), v.unsqueeze(2)).reshape(R, H, n, D)


# Padded K/V elements an extra attention call must save to pay for its fixed cost (~0.1 ms of
# call overhead is worth ~1 MB of memory traffic; each padded element is read/written ~6 times).
_SPLIT_MIN_SAVED_ELEMS = 64 * 1024


def _length_buckets(rows: list[int], ctx: list[int], elems_per_token: int) -> list[list[int]]:
    """Cut rows (sorted by context length) so that each bucket is padded only to its own
    longest context; a cut is made only where the padding it saves is worth another call."""
    if len(rows) < 2:
        return [rows]
    mid = len(rows) // 2
    lo, hi = rows[:mid], rows[mid:]
    saved_tokens = len(lo) * (ctx[rows[-1]] - ctx[lo[-1]])
    if saved_tokens * elems_per_token < _SPLIT_MIN_SAVED_ELEMS:
        return [rows]
    return _length_buckets(lo, ctx, elems_per_token) + _length_buckets(hi, ctx, elems_per_token)


def rms_norm(
    x: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, d]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32; with `residual`, normalises x + residual and returns (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] = cat(cos, sin) over rot_dim // 2
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim dims of each head by its position's angles. neox pairs
    element j with j + rot_dim/2; GPT-J pairs interleaved (2j, 2j+1). Dims past rot_dim pass
    through."""
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache[positions]  # [T, rot_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, rot_dim // 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # Written into one output through strided views: no cat, no half-size copies.
        out = x.clone() if rot < x.shape[-1] else torch.empty_like(x)
        step = (slice(0, half), slice(half, rot)) if is_neox else (slice(0, rot, 2), slice(1, rot, 2))
        x1, x2 = x[..., step[0]], x[..., step[1]]
        o1, o2 = out[..., step[0]], out[..., step[1]]
        if x.dtype == torch.float32:
            torch.mul(x1, cos, out=o1).sub_(x2 * sin)
            torch.mul(x2, cos, out=o2).add_(x1 * sin)
        else:  # 16-bit: compute in fp32, round once
            x1, x2 = x1.float(), x2.float()
            o1.copy_(x1 * cos - x2 * sin)
            o2.copy_(x2 * cos + x1 * sin)
        return out

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]"""
    d = x.shape[-1] // 2
    # silu on a contiguous copy is several times faster on CPU than on the strided half.
    gate = x[..., :d].contiguous()
    return F.silu(gate, inplace=True).mul_(x[..., d:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> gelu(x[..., :d], approximate="tanh") * x[..., d:] (GeGLU, Gemma's MLP)"""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


def lora_shrink(
    x: torch.Tensor,  # [T, K] a projection's input
    a_stack: torch.Tensor,  # [L, R, K] each slot's stacked A matrices (R = slices x max rank)
    mapping,  # kernels.lora_mapping.LoRAMapping of this step
) -> torch.Tensor:  # [T, R] fp32
    """Punica's shrink: s[t] = x[t] @ a_stack[slot(t)]^T for tokens with an adapter; the rows
    of base-model tokens (slot -1) are zeros. Accumulated and returned in fp32."""
    slots = mapping.token_slots
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots[slots >= 0].unique().tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        out[rows] = x[rows].float() @ a_stack[slot].float().T
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N] the base projection's output, added to in place
    s: torch.Tensor,  # [T, R] lora_shrink's output
    b_stack: torch.Tensor,  # [L, N, R] each slot's B matrices, scaling folded in
    mapping,  # kernels.lora_mapping.LoRAMapping of this step
) -> None:
    """Punica's expand: y[t] += s[t] @ b_stack[slot(t)]^T for tokens with an adapter (in fp32,
    rounded once to y's dtype); base-model rows are untouched."""
    slots = mapping.token_slots
    for slot in slots[slots >= 0].unique().tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        y[rows] = (y[rows].float() + s[rows].float() @ b_stack[slot].float().T).to(y.dtype)


def lora_apply(
    y: torch.Tensor,  # [T, N] the base projection's output, added to in place
    x: torch.Tensor,  # [T, K] its input
    a_stack: torch.Tensor,  # [L, R, K]
    b_stack: torch.Tensor,  # [L, N, R]
    mapping,
) -> None:
    """One projection's whole LoRA delta: lora_expand(y, lora_shrink(x, a_stack), b_stack).
    Implementations may fuse the two (the CPU path keeps the shrink's rows grouped by slot)."""
    lora_expand(y, lora_shrink(x, a_stack, mapping), b_stack, mapping)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf unless bit t % 32 of bitmask[i, t // 32] is set.

    logits [N, V] float; bitmask [M, W] int32 (structured outputs' layout); rows [M] int64,
    the logits row of each mask row. Tokens past 32 * W are masked."""
    M, W = bitmask.shape
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(M, W * 32)  # [M, 32W]
    if W * 32 >= V:
        allowed = allowed[:, :V]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros(M, V - W * 32)], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows then its up rows
    w2: torch.Tensor,  # [E, H, I]: each expert's down projection
    topk_weights: torch.Tensor,  # [T, k] routing weights (already softmaxed/renormalised)
    topk_ids: torch.Tensor,  # [T, k] expert of each (token, slot)
    expert_start: int | None = None,
) -> torch.Tensor:  # [T, H]
    """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    Each expert's SwiGLU MLP runs in the activation dtype on the tokens routed to it; the
    weighted contributions are summed in fp32 and rounded once, so the result does not depend
    on the order in which experts are visited.

    Expert parallel: with `expert_start`, w13/w2 hold only experts [expert_start, expert_start
    + E) of the model, and a (token, slot) routed to any other expert contributes nothing (its
    expert lives on another rank, which adds it in)."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)  # [T*k], pair p is token p // k
    if expert_start is not None:
        flat_ids = flat_ids - expert_start  # local ids; outside [0, E): another rank's expert
    flat_weights = topk_weights.reshape(-1).float()
    for e in flat_ids.unique().tolist():
        if not 0 <= e < E:
            continue
        pairs = (flat_ids == e).nonzero().squeeze(1)  # [n]
        tokens = pairs // k
        h = F.linear(silu_and_mul(F.linear(hidden[tokens], w13[e])), w2[e])  # [n, H]
        out.index_add_(0, tokens, h.float() * flat_weights[pairs, None])
    return out.to(hidden.dtype)
