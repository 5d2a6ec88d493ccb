"""kernels.cpu.half: products with fp16 / bf16 weights held to the fp32 upcast's product (the
float64 product of the same values, within fp32 summation rounding)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import half

DTYPES = (torch.float16, torch.bfloat16)


def check_product(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """y is x @ w.float().T up to fp32 summation: within 1e-6 of |x| @ |w|^T per output."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape, what
    assert ((y.double() - ref).abs() <= 1e-6 * mag + 1e-30).all(), what


def all_finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the 16-bit type (subnormals and both zeros included), [n / 16, 16]."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    return values[values.float().isfinite()].reshape(-1, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_finite_weight_value_is_widened_exactly(dtype):
    # One-hot rows pick each weight value alone: the product is the value, with no rounding.
    w = all_finite_values(dtype)
    y = half.half_matmul(torch.eye(16), w)
    assert torch.equal(y, w.float().T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_of_any_batch_and_row_length_match_the_upcast(dtype):
    g = torch.Generator().manual_seed(0)
    # Row lengths with and without a partial vector at the end; output rows not a whole tile.
    for N, K in ((37, 200), (64, 512), (5, 17)):
        w = torch.randn(N, K, generator=g).to(dtype)
        for T in (1, 2, 3, 5, 9):
            x = torch.randn(T, K, generator=g)
            y = half.half_matmul(x, w)
            check_product(x, w, y, f"{dtype} N={N} K={K} T={T}")
            torch.testing.assert_close(y, half.half_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_out_are_taken_as_they_are():
    g = torch.Generator().manual_seed(1)
    big_w = torch.randn(40, 160, generator=g).half()
    w = big_w[:, 16:144]  # rows 160 apart
    x = torch.randn(6, 200, generator=g)[:, 8:136]
    out = torch.full((6, 50), 7.0)
    got = half.half_matmul(x, w, out=out[:, 5:45])
    check_product(x, w, got, "strided")
    assert got.data_ptr() == out[:, 5:45].data_ptr()
    assert (out[:, :5] == 7).all() and (out[:, 45:] == 7).all()


def test_one_and_two_threads_give_the_same_result():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 256, generator=g).bfloat16()
    x = torch.randn(3, 256, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = half.half_matmul(x, w)
        torch.set_num_threads(2)
        two = half.half_matmul(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_arguments_are_refused_by_name():
    w, x = torch.zeros(8, 32, dtype=torch.float16), torch.zeros(2, 32)
    cases = [
        (x, w.float(), None, "weight must be a 2-D float16 or bfloat16"),
        (x, w.T, None, "weight rows must be contiguous"),
        (x[:, :16], w, None, r"x must be fp32 \[T, 32\]"),
        (x.double(), w, None, "x must be fp32"),
        (torch.zeros(32, 2).T, w, None, "x rows must be contiguous"),
        (x, w, torch.zeros(2, 9), r"out must be fp32 \[2, 8\]"),
    ]
    for xs, ws, out, words in cases:
        with pytest.raises(ValueError, match=words):
            half.half_matmul(xs, ws, out)
