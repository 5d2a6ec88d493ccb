"""kernels.triton_kernels.gguf: products with GGUF blocks dequantized in the kernel, against
x @ dequantize(W)^T (engine.models.gguf_quants, bit-exact with gguf-py). On CPU under
TRITON_INTERPRET=1; in a GPU session (PDSERVE_TEST_GPU=1) the gpu-marked ones run compiled on
CUDA. tests/kernels/test_triton_compile.py compiles every type for sm_90.

Tolerances: fp32 activations get the exact fp32 weights and exact products, so only the
summation order differs (1e-5 of |x| @ |W|^T); 16-bit activations multiply the weights rounded
to their dtype (what a 16-bit model loads), so the reference rounds W the same way and the
result is held to the output's rounding (2^-7 of |x| @ |W|^T for bf16).
"""

from __future__ import annotations

import pytest
import torch

from engine.models import quant_linear
from engine.models.gguf_quants import dequantize
from engine.models.quant_linear import QuantWeight
from kernels.triton_kernels import gguf, gguf_words
from tests.kernels.test_quant_cpu import random_qweight, stable_seed


def _case(qtype: str, N: int, K: int, device: str):
    qw = random_qweight(qtype, N, K, seed=stable_seed(qtype, N, K))
    W = dequantize(qw.reshape(-1), qtype, (N, K))
    return qw.to(device), W.to(device)


def _check(y: torch.Tensor, x: torch.Tensor, W: torch.Tensor, tol: float, what: str) -> None:
    Wr = W.to(x.dtype).double()  # the weights the kernel multiplies: W rounded to x's dtype
    ref = x.double() @ Wr.T
    mag = x.double().abs() @ Wr.abs().T + 1e-30
    err = float(((y.double() - ref).abs() / mag).max())
    assert err <= tol, f"{what}: off by {err:.2e} of |x| @ |W|"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", gguf.SUPPORTED)
def test_every_type_matches_the_dequantized_product(qtype, device):
    values = gguf.QTYPES[qtype][1]
    N, K = 40, 2 * max(values, 64)  # N past one 32-row tile; K several 32-value k-tiles
    qw, W = _case(qtype, N, K, device)
    for T in (1, 17):  # one row; more than one 16-row tile
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(device)
        y = gguf.gguf_matmul(x, qw, qtype, K)
        assert y.dtype == torch.float32 and y.shape == (T, N)
        _check(y, x, W, 1e-5, f"{qtype} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype, dtype", [("Q4_K", torch.bfloat16), ("Q6_K", torch.bfloat16),
                                          ("Q8_0", torch.float16), ("Q4_1", torch.bfloat16)])
def test_16_bit_activations_multiply_the_weights_rounded_to_their_dtype(qtype, dtype, device):
    K = 256
    qw, W = _case(qtype, 24, K, device)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y = gguf.gguf_matmul(x, qw, qtype, K)
    assert y.dtype == dtype
    _check(y, x, W, 2**-7 if dtype == torch.bfloat16 else 2**-10, f"{qtype} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", gguf.SUPPORTED)
def test_the_one_row_per_program_tiling_matches_too(qtype, device):
    """The gemv launch (one token row per program, no dot tile), fp32 and bf16."""
    values = gguf.QTYPES[qtype][1]
    N, K = 40, 2 * max(values, 64)
    qw, W = _case(qtype, N, K, device)
    tiles = gguf.Tiles("gemv", block_n=16, block_k=64)
    for T in (1, 3):
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(device)
        _check(gguf.gguf_matmul(x, qw, qtype, K, tiles), x, W, 1e-5, f"{qtype} T={T}")
        xb = x.to(torch.bfloat16)
        y = gguf.gguf_matmul(xb, qw, qtype, K, tiles)
        assert y.dtype == torch.bfloat16
        _check(y, xb, W, 2**-7, f"{qtype} T={T} bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", gguf_words.WORD_TYPES)
def test_the_whole_word_kernels_match(qtype, device):
    """Q4_K / Q6_K at decode sizes (the default tiling up to WORDS_MAX_T rows): rows past a
    whole tile, two blocks per row, fp32 on a 16-row tile and bf16 on the default ones. They
    multiply the exact weights, so bf16 is held to the rounded reference's bound."""
    N, K = 40, 512
    qw, W = _case(qtype, N, K, device)
    assert gguf.default_tiles(1, qtype).method == "words"
    tiles = gguf.Tiles("words", 16)
    for T in (1, 3):
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(device)
        _check(gguf.gguf_matmul(x, qw, qtype, K, tiles), x, W, 1e-5, f"{qtype} T={T}")
        xb = x.to(torch.bfloat16)
        y = gguf.gguf_matmul(xb, qw, qtype, K)
        assert y.dtype == torch.bfloat16
        _check(y, xb, W, 2**-7, f"{qtype} T={T} bf16")


def test_a_kept_projection_of_mixed_types_through_the_triton_branch():
    """QuantWeight's GPU branch (triton_parts), run here on CPU: segments of differing types
    side by side, as a Q4_K_M file's attn_v in Q6_K beside Q4_K q and k."""
    K = 256
    qw = QuantWeight(56, K)
    parts = [(0, 32, "Q4_K"), (32, 56, "Q6_K")]
    for start, stop, qtype in parts:
        qw.add(start, stop, qtype, random_qweight(qtype, stop - start, K, seed=start))
    x = torch.randn(3, K)
    y = torch.cat(qw.triton_parts(x), dim=-1)
    _check(y, x, qw.dequantize(), 1e-5, "segments")


def test_cuda_keeps_blocks_only_when_opted_in(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(quant_linear, "TRITON_GGUF", False)
    assert not quant_linear.kernel_supports("Q4_K", 256, cuda)  # dequantized at load (untimed on GPU)
    monkeypatch.setattr(quant_linear, "TRITON_GGUF", True)
    assert quant_linear.kernel_supports("Q4_K", 256, cuda) and quant_linear.kernel_supports("Q8_0", 96, cuda)
    assert not quant_linear.kernel_supports("Q4_K", 96, cuda)  # not whole 256-value blocks
    assert not quant_linear.kernel_supports("IQ4_XS", 256, cuda)  # no kernel: dequantized


def test_bad_arguments_are_refused_by_name():
    qw, _ = _case("Q4_0", 8, 64, "cpu")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="Q2_K"):
        gguf.gguf_matmul(x, qw, "Q2_K", 64)
    with pytest.raises(ValueError, match="K=48"):
        gguf.gguf_matmul(torch.randn(2, 48), qw, "Q4_0", 48)
    with pytest.raises(ValueError, match="rows are 36 bytes"):
        gguf.gguf_matmul(torch.randn(2, 96), qw, "Q4_0", 96)
    with pytest.raises(ValueError, match="x must be"):
        gguf.gguf_matmul(x.double(), qw, "Q4_0", 64)
    with pytest.raises(ValueError, match="x must be"):
        gguf.gguf_matmul(torch.randn(64, 2).T, qw, "Q4_0", 64)  # rows not contiguous
    with pytest.raises(ValueError, match="tiles.method"):
        gguf.gguf_matmul(x, qw, "Q4_0", 64, gguf.Tiles("gemm", 16))
