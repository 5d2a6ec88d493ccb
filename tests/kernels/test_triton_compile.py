"""Every Triton kernel compiles to PTX for Hopper (sm_90, the H200) without a GPU.

The interpreter checks what the kernels compute; this checks what only the real compiler
enforces (types of loop-carried values, dot shapes, constexpr use) for the launches the
wrappers make on a GPU. Run as a script in a subprocess (`python -m tests.kernels.
test_triton_compile`), because with TRITON_INTERPRET=1 set, kernels cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_kernels import activation, attention, cache, gguf, gguf_words, moe, norm, rotary

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict, constexprs: dict) -> str:
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=HOPPER).asm["ptx"]


def _ints(*names):
    return {n: "i32" for n in names}


ATTN_SIG = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_table_ptr": "*i32",
    "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32", "scale": "fp32", "window": "i32", "softcap": "fp32",
    **_ints("num_reqs", "num_tokens", "q_st", "q_sh", "o_st", "o_sh", "c_sb", "c_so", "c_sh", "bt_stride"),
}


def compile_paged_attention(splits, upcast, head_dim, group, gemma=False):
    g_pad = triton.next_power_of_2(group)
    sig = dict(ATTN_SIG)
    if upcast:
        sig.update({k: "*fp32" for k in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")})
    ptx = _compile(attention._paged_attention_kernel, sig, dict(
        NUM_HEADS=group * 2, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, BLOCK_D=head_dim, PAGE=16,
        BLOCK_Q=max(1, 64 // g_pad), BLOCK_N=64, NUM_SPLITS=splits, UPCAST=upcast,
        WINDOWED=gemma, SOFTCAPPED=gemma))
    assert ".entry" in ptx


def compile_split_reduce():
    sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", **_ints("num_tokens", "o_st", "o_sh")}
    assert ".entry" in _compile(attention._reduce_splits_kernel, sig, dict(
        NUM_HEADS=32, HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=5, BLOCK_S=8))


def compile_elementwise():
    cache_sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16",
                 "slot_ptr": "*i64", **_ints("k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h",
                                             "c_stride_slot", "c_stride_h")}
    _compile(cache._reshape_and_cache_kernel, cache_sig, dict(NUM_KV_HEADS=3, BLOCK_H=4, HEAD_DIM=128, BLOCK_D=128))
    norm_sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
                **_ints("x_stride", "res_stride", "out_stride", "res_out_stride", "dim"), "eps": "fp32"}
    _compile(norm._rms_norm_kernel, norm_sig, dict(HAS_RESIDUAL=True, BLOCK=2048))
    act_sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", **_ints("x_stride", "out_stride", "d")}
    _compile(activation._silu_and_mul_kernel, act_sig, dict(BLOCK=1024))
    _compile(activation._gelu_tanh_and_mul_kernel, act_sig, dict(BLOCK=1024))
    rot_sig = {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cache_ptr": "*fp32", "qo_ptr": "*bf16",
               "ko_ptr": "*bf16", **_ints("q_st", "q_sh", "k_st", "k_sh", "qo_st", "qo_sh", "ko_st", "ko_sh",
                                          "cache_stride", "num_q_heads", "num_k_heads", "head_dim")}
    for neox in (True, False):
        _compile(rotary._rotary_kernel, rot_sig, dict(ROT_HALF=64, IS_NEOX=neox, BLOCK_H=32, BLOCK_R=64, BLOCK_D=1))


def compile_fused_moe(dtype: str, upcast: bool):
    common = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32",
              **_ints("num_pairs", "num_experts", "H", "inter", "w_se", "w_sn", "w_sk", "inter_stride")}
    tiles = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, UPCAST=upcast)
    gate_up_sig = {"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "inter_ptr": f"*{dtype}", **common,
                   **_ints("x_stride")}
    assert ".entry" in _compile(moe._gate_up_kernel, gate_up_sig, dict(TOPK=2, **tiles))
    down_sig = {"inter_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "out_ptr": "*fp32", "weights_ptr": "*fp32",
                **common, **_ints("out_stride")}
    assert ".entry" in _compile(moe._down_kernel, down_sig, tiles)


def compile_gguf(qtype: str, dtype: str, upcast: bool):
    code, qk, bb = gguf.QTYPES[qtype]
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "out_ptr": f"*{dtype}",
           **_ints("T", "N", "K", "x_stride", "out_stride", "row_bytes")}
    assert ".entry" in _compile(gguf._gguf_matmul_kernel, sig, dict(
        QTYPE=code, QK=qk, BB=bb, BLOCK_T=64, BLOCK_N=64, BLOCK_K=32, UPCAST=upcast))


def compile_gguf_one_row():
    """The one-token-row kernels: the general gemv on every type, the whole-word Q4_K / Q6_K
    at the default tilings' widths."""
    common = {"x_ptr": "*bf16", "out_ptr": "*bf16", **_ints("N", "K", "x_stride", "out_stride")}
    for qtype in ("Q5_1", "Q8_0", "Q5_K"):  # its dequantization is the dot kernel's, compiled for all
        code, qk, bb = gguf.QTYPES[qtype]
        assert ".entry" in _compile(gguf._gguf_gemv_kernel, {**common, "w_ptr": "*u8", "row_bytes": "i32"},
                                    dict(QTYPE=code, QK=qk, BB=bb, BLOCK_N=16, BLOCK_K=128))
    for block_n in (8, 32):
        assert ".entry" in _compile(gguf_words._q4k_word_kernel, {**common, "w_ptr": "*i32", "row_words": "i32"},
                                    dict(BLOCK_N=block_n))
    for block_n in (2, 4):
        assert ".entry" in _compile(gguf_words._q6k_word_kernel, {**common, "w_ptr": "*i16", "row_halves": "i32"},
                                    dict(BLOCK_N=block_n))


def main() -> None:
    # (splits, upcast, head_dim, group[, sliding window and softcap]). The fp32 (upcast) path is
    # compiled at head_dim 64: at 256 the same code takes ~18 s of LLVM/ptxas time (fp32 tiles
    # twice as wide), which no other check needs; head_dim 256 is compiled on the bf16 path.
    for case in [(1, False, 128, 4), (4, False, 64, 7), (1, False, 256, 1), (2, True, 64, 4),
                 (4, False, 256, 2, True)]:
        compile_paged_attention(*case)
        print("compiled paged_attention", case)
    compile_split_reduce()
    print("compiled split reduce")
    compile_elementwise()
    print("compiled elementwise")
    for dtype, upcast in (("bf16", False), ("fp32", True)):
        compile_fused_moe(dtype, upcast)
        print("compiled fused_moe", dtype)
    for qtype in gguf.SUPPORTED:  # every block format on the bf16 path; the fp32 one once
        compile_gguf(qtype, "bf16", False)
    compile_gguf("Q4_K", "fp32", True)
    print("compiled gguf_matmul")
    compile_gguf_one_row()
    print("compiled gguf one-row kernels")


def test_all_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_triton_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 11


if __name__ == "__main__":
    main()
