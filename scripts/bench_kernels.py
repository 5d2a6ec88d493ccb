"""Kernel speed on a CUDA GPU: Triton paged_attention (decode) against torch SDPA on dense
K/V, with achieved GB/s and % of peak HBM bandwidth; plus the element-wise kernels against
their torch references, fused_moe (Triton grouped GEMM vs the per-expert torch loop) at
Mixtral-8x7B and Qwen3-30B-A3B expert shapes, and gguf_matmul (GGUF blocks dequantized in the
kernel) against the dense bf16 product of the dequantized weight, with the block bytes' GB/s:
what decides whether a GPU should keep GGUF blocks (PDSERVE_GGUF_TRITON=1). Needs CUDA.

    python scripts/bench_kernels.py [--heads 32 --kv-heads 8 --head-dim 128] [--peak-gbps N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.gpu_roofline import decode_attention_bytes, peak_bandwidth_gbps  # noqa: E402


def _time_us(fn, *args, **kwargs) -> float:
    """Median microseconds of fn(*args) by triton's do_bench (warm-up, L2 flush, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(lambda: fn(*args, **kwargs)) * 1e3


def bench_decode_attention(args, peak):
    from kernels import triton_kernels as tk

    dtype = getattr(torch, args.dtype)
    H, Hkv, D, page = args.heads, args.kv_heads, args.head_dim, 16
    itemsize = torch.empty((), dtype=dtype).element_size()
    print(f"\npaged_attention decode, H={H} Hkv={Hkv} D={D} {args.dtype}, page {page}")
    print(f"{'batch':>6} {'ctx':>6} {'triton us':>10} {'GB/s':>8} {'%peak':>6} {'sdpa us':>9} {'GB/s':>8}")
    for batch in args.batches:
        for ctx in args.contexts:
            nb = -(-ctx // page)
            kc = torch.randn(batch * nb, page, Hkv, D, device="cuda", dtype=dtype)
            vc = torch.randn_like(kc)
            table = torch.randperm(batch * nb, device="cuda", dtype=torch.int32).view(batch, nb)
            q = torch.randn(batch, H, D, device="cuda", dtype=dtype)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            seq = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            t_tri = _time_us(tk.paged_attention, q, kc, vc, table, qsl, seq, D**-0.5, out)
            kd = kc.view(batch, nb * page, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
            vd = vc.view(batch, nb * page, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
            qd = q.unsqueeze(2)
            t_sdpa = _time_us(torch.nn.functional.scaled_dot_product_attention, qd, kd, vd,
                              scale=D**-0.5, enable_gqa=True)
            nbytes = decode_attention_bytes(batch, ctx, H, Hkv, D, itemsize)
            gbs_tri, gbs_sdpa = nbytes / t_tri / 1e3, nbytes / t_sdpa / 1e3
            pct = f"{100 * gbs_tri / peak:5.1f}" if peak else "  n/a"
            print(f"{batch:>6} {ctx:>6} {t_tri:>10.1f} {gbs_tri:>8.0f} {pct:>6} {t_sdpa:>9.1f} {gbs_sdpa:>8.0f}")


def bench_decode_attention_batch1(args):
    """Batch 1 across contexts and KV splits, each timed three times: the 62 us at 2,048 tokens
    the first H200 run showed (docs/benchmarks.md#paged-attention) was never explained."""
    from kernels import triton_kernels as tk

    dtype = getattr(torch, args.dtype)
    H, Hkv, D, page = args.heads, args.kv_heads, args.head_dim, 16
    itemsize = torch.empty((), dtype=dtype).element_size()
    print("\npaged_attention decode at batch 1 (us, three timings each): splits None = the default")
    for ctx in (512, 1024, 2048, 4096, 8192, 16384):
        nb = -(-ctx // page)
        kc = torch.randn(nb, page, Hkv, D, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        table = torch.randperm(nb, device="cuda", dtype=torch.int32).view(1, nb)
        q = torch.randn(1, H, D, device="cuda", dtype=dtype)
        qsl = torch.arange(2, device="cuda", dtype=torch.int32)
        seq = torch.full((1,), ctx, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        cells = []
        for splits in (None, 1, 4, 8, 16, 32):
            times = [_time_us(tk.paged_attention, q, kc, vc, table, qsl, seq, D**-0.5, out, num_kv_splits=splits)
                     for _ in range(3)]
            cells.append(f"{splits}: " + "/".join(f"{t:.0f}" for t in times))
        mb = decode_attention_bytes(1, ctx, H, Hkv, D, itemsize) / 1e6
        print(f"  ctx {ctx:>6} ({mb:.1f} MB): " + "; ".join(cells))


def bench_elementwise(args):
    from kernels import reference as ref
    from kernels import triton_kernels as tk

    dtype = getattr(torch, args.dtype)
    T, hidden, H, Hkv, D = 4096, args.heads * args.head_dim, args.heads, args.kv_heads, args.head_dim
    x = torch.randn(T, hidden, device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    gu = torch.randn(T, 2 * 4 * hidden, device="cuda", dtype=dtype)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=dtype)
    pos = torch.randint(0, 4096, (T,), device="cuda")
    cache = torch.randn(4096, D, device="cuda", dtype=torch.float32)
    print(f"\nelement-wise kernels, {T} tokens, {args.dtype} (us: triton / torch reference)")
    for label, name, fn_args in (
        ("rms_norm+residual", "rms_norm", (x, w, 1e-6, res)),
        ("silu_and_mul", "silu_and_mul", (gu,)),
        ("rotary_embedding", "rotary_embedding", (pos, q, k, cache, True)),
    ):
        t_tri = _time_us(getattr(tk, name), *fn_args)
        t_ref = _time_us(getattr(ref, name), *fn_args)
        print(f"  {label:<20} {t_tri:8.1f} / {t_ref:8.1f}")


# (label, experts, top-k, hidden, expert intermediate size)
MOE_SHAPES = (("mixtral-8x7b", 8, 2, 4096, 14336), ("qwen3-30b-a3b", 128, 8, 2048, 768))


def bench_fused_moe(args):
    from kernels import reference as ref
    from kernels import triton_kernels as tk

    dtype = getattr(torch, args.dtype)
    print(f"\nfused_moe, {args.dtype} (us: triton / torch reference)")
    for label, E, k, H, inter in MOE_SHAPES:
        w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=dtype) / H**0.5
        w2 = torch.randn(E, H, inter, device="cuda", dtype=dtype) / inter**0.5
        for T in (1, 64, 1024):
            x = torch.randn(T, H, device="cuda", dtype=dtype)
            weights, ids = torch.randn(T, E, device="cuda").softmax(-1).topk(k, -1)
            fn_args = (x, w13, w2, weights, ids)
            t_tri = _time_us(tk.fused_moe, *fn_args)
            t_ref = _time_us(ref.fused_moe, *fn_args)
            print(f"  {label:<14} T={T:<5} {t_tri:10.1f} / {t_ref:10.1f}")
        del w13, w2


# (label, N, K): a Llama-2-7B's gate/up and down, a 1B model's gate/up.
GGUF_SHAPES = [("7B gate/up", 22016, 4096), ("7B down", 4096, 11008), ("1B gate/up", 11264, 2048)]


def bench_gguf(args):
    from kernels.triton_kernels import gguf

    print("\ngguf_matmul, bf16 activations (us: kept blocks / dense bf16 of the dequantized weight; "
          "block GB/s at T=1)")
    for qtype in ("Q4_K", "Q6_K", "Q8_0", "Q4_0"):
        for label, N, K in GGUF_SHAPES:
            _, values, nbytes = gguf.QTYPES[qtype]
            qw = torch.randint(0, 256, (N, K // values * nbytes), dtype=torch.uint8, device="cuda")  # speed only
            dense = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            for T in (1, 16, 512):
                x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
                t_q = _time_us(gguf.gguf_matmul, x, qw, qtype, K)
                t_d = _time_us(torch.nn.functional.linear, x, dense)
                gbps = f"  {qw.numel() / t_q / 1e3:7.0f} GB/s" if T == 1 else ""
                print(f"  {qtype} {label:<11} T={T:<4} {t_q:9.1f} / {t_d:9.1f}{gbps}")
            del qw, dense


def bench_gguf_tiles(args):
    """The tilings of gguf_matmul at decode sizes: which one the default should be."""
    from kernels.triton_kernels import gguf, gguf_words

    T_ = gguf.Tiles
    sweep = [T_("dot", bn, bk, 16, 4) for bn in (32, 64, 128) for bk in (32, 64)]
    sweep += [T_("gemv", 16, bk, 1, w) for bk in (64, 128, 256) for w in (2, 4)] + [T_("gemv", 8, 256, 1, 4)]
    sweep += [T_("words", bn, 32, 1, w) for bn in (2, 4, 8, 16, 32) for w in (1, 2, 4)]
    print("\ngguf_matmul tilings, bf16 (us; block GB/s at T=1): dot = BLOCK_T rows share a tile, gemv = one row")
    for qtype, (label, N, K) in (("Q4_K", GGUF_SHAPES[2]), ("Q6_K", GGUF_SHAPES[1]), ("Q8_0", GGUF_SHAPES[2])):
        _, values, nbytes = gguf.QTYPES[qtype]
        qw = torch.randint(0, 256, (N, K // values * nbytes), dtype=torch.uint8, device="cuda")
        for T in (1, 4, 16):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            dense = _time_us(torch.nn.functional.linear, x, torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
            rows = []
            for tiles in sweep:
                if ((tiles.block_k % values and values % tiles.block_k) or (tiles.method == "gemv" and T > 4)
                        or (tiles.method == "words" and qtype not in gguf_words.WORD_TYPES)):
                    continue
                try:
                    rows.append((_time_us(gguf.gguf_matmul, x, qw, qtype, K, tiles), tiles))
                except Exception as e:  # a tiling the compiler refuses (shared memory, registers)
                    print(f"  {tiles}: {type(e).__name__}")
            rows.sort(key=lambda r: r[0])
            best = ", ".join(f"{t.method} n{t.block_n} k{t.block_k} w{t.num_warps} "
                             f"{us:.1f}" for us, t in rows[:4])
            default = _time_us(gguf.gguf_matmul, x, qw, qtype, K)
            print(f"  {qtype} {label} T={T}: dense {dense:.1f}, default {default:.1f}, best: {best}; "
                  f"best GB/s {qw.numel() / rows[0][0] / 1e3:.0f}")
        del qw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    ap.add_argument("--only", nargs="+", default=None, choices=["attention", "attention1", "elementwise", "moe", "gguf", "tiles"],
                    help="run only these parts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (the kernels are tested on CPU by the test suite)")
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth_gbps(name, args.peak_gbps)
    print(f"device: {name}, peak HBM bandwidth: {peak or 'unknown'} GB/s")
    parts = {"attention": lambda: bench_decode_attention(args, peak),
             "attention1": lambda: bench_decode_attention_batch1(args), "elementwise": lambda: bench_elementwise(args),
             "moe": lambda: bench_fused_moe(args), "gguf": lambda: bench_gguf(args),
             "tiles": lambda: bench_gguf_tiles(args)}
    for name, run in parts.items():
        if args.only is None or name in args.only:
            run()


if __name__ == "__main__":
    main()
