"""kernels.cpu.quant: products and embedding lookups on GGUF blocks kept quantized, against
x @ dequantize(W)^T with engine.models.gguf_quants (bit-exact with gguf-py).

Tolerances. fp32 method: the weights are dequantized exactly, so only the summation order
differs: |y - ref| <= 1e-5 * (|x| @ |W|^T). int8 method: it computes x_q @ W^T where x_q is x
rounded per 32 values to int8 steps of max|x| / 127. We emulate that rounding in torch and hold
the kernel to fp32 rounding of x_q @ W^T (this catches any wrong lane, scale or offset), and
check the documented accuracy against exact fp32 math: rounding moves each x by at most half a
step, so |y - ref| <= (step / 2) @ |W|^T elementwise, a bound that holds for any data.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
import torch

from engine.models.gguf_quants import dequantize
from kernels.cpu import quant
from tests.engine.gguf_factory import FP16_FIELDS

TYPES = list(quant.QTYPES)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
BLOCK32 = [t for t in TYPES if quant.QTYPES[t][1] == 32]
pytestmark = pytest.mark.skipif(not quant.supported("Q4_0", 32), reason="native CPU kernels not built")


def random_qweight(qtype: str, N: int, K: int, seed: int) -> torch.Tensor:
    """Random valid rows: random bytes for the integer fields, fp16 scales of either sign
    and magnitude 2^-12..2^-9 (real weights' range)."""
    rng = np.random.default_rng(seed)
    _, values, nbytes = quant.QTYPES[qtype]
    blocks = rng.integers(0, 256, (N * K // values, nbytes), dtype=np.uint8)
    for start in FP16_FIELDS[qtype]:
        scale = rng.uniform(2**-12, 2**-9, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, start:start + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(N, -1))


def stable_seed(*key) -> int:
    """A seed from key's repr that every run draws the same (hash() of a str is salted per
    process, so a failure seeded by it could not be reproduced)."""
    return zlib.crc32(repr(key).encode())


@functools.lru_cache(maxsize=32)
def _case(qtype: str, N: int, K: int):
    """(qweight, W, |W|): W the dequantized weight in float64, |W| in float32 (for bounds)."""
    qw = random_qweight(qtype, N, K, seed=stable_seed(qtype, N, K))
    W = dequantize(qw.reshape(-1), qtype, (N, K))
    return qw, W.double(), W.abs()


def _int8_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, step): x rounded as the int8 path rounds it, per 32 values, in fp32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # not 127 / amax: torch takes a reciprocal
    xq = torch.round(blocks * inv) * (amax / 127.0)
    return xq.reshape(x.shape), (amax / 127.0).expand_as(blocks).reshape(x.shape)


def _check(outputs: dict[str, torch.Tensor], x: torch.Tensor, case, what: str) -> None:
    """outputs: method -> quant_matmul's result for x."""
    _, W, Wabs = case
    T = x.shape[0]
    xq, step = _int8_rounded(x)
    ref, emulated = (torch.cat([x, xq]).double() @ W.T).split(T)
    mag, qmag, reach = (torch.cat([x.abs(), xq.abs(), step / 2]) @ Wabs.T).double().split(T)
    mag, qmag, reach = mag * 1.001, qmag * 1.001, reach * 1.001  # their own fp32 rounding
    for method, y in outputs.items():
        y = y.double()
        if method == "fp32":
            err = ((y - ref).abs() / (mag + 1e-30)).max()
            assert err <= 1e-5, f"{what}: fp32 method off by {err:.2e} of |x|@|W|"
            continue
        err = ((y - emulated).abs() / (qmag + 1e-30)).max()
        assert err <= 1e-5, f"{what}: {method} method off its rounded-activation product by {err:.2e}"
        assert ((y - ref).abs() <= reach + 1e-5 * mag).all(), f"{what}: {method} error beyond the rounding bound"


# (N, K): small with K not a multiple of 256 for the 32-value types; SmolLM2-135M's MLP.
SHAPES = {32: [(40, 96), (1536, 576), (576, 1536)], 256: [(40, 512), (576, 1536), (24, 2304)]}


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_matches_the_dequantized_product(qtype):
    for N, K in SHAPES[quant.QTYPES[qtype][1]]:
        case = _case(qtype, N, K)
        for T in (1, 3, 17, 64, quant.GEMM_ROWS + 2):  # the last: fp32 through dequantized blocks
            x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
            outputs = {m: quant.quant_matmul(x, case[0], qtype, K, method=m) for m in ("int8", "fp32")}
            _check(outputs, x, case, f"{qtype} {N}x{K} T={T}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_strided_rows_more_than_a_tile_of_rows_and_auto(qtype):
    # 70 rows: more than one 64-row tile; x and out with row strides; N not a multiple of 4.
    N, K = 37, quant.QTYPES[qtype][1] * 3
    case = _case(qtype, N, K)
    x = torch.randn(70, K + 5)[:, :K]
    for method in ("int8", "fp32", "auto"):
        out = torch.full((70, N + 3), float("nan"))
        y = quant.quant_matmul(x, case[0], qtype, K, out=out[:, :N], method=method)
        assert y.data_ptr() == out.data_ptr() and torch.isnan(out[:, N:]).all()
        # auto is the engine's choice: fp32 unless PDSERVE_QUANT_ACTIVATIONS=int8.
        engine_int8 = quant.METHODS["auto"] == quant.METHODS["int8"]
        checked = method if method != "auto" else ("int8" if engine_int8 else "fp32")
        _check({checked: y}, x, case, f"{qtype} {method}")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_short_row_end_ignores_the_bytes_after_it(qtype):
    # K = 96: each row ends in a 3-block chunk, which the kernel reads on into the next rows;
    # their scales are inf and NaN here, and must not reach row 0 (nor the last row's copy).
    N, K = 4, 96
    qw = random_qweight(qtype, N, K, seed=9)
    nbytes = quant.QTYPES[qtype][2]
    for row, value in ((1, np.inf), (2, np.nan)):
        blocks = qw[row].numpy().reshape(3, nbytes)
        for start in FP16_FIELDS[qtype]:
            blocks[:, start:start + 2] = np.full((3, 1), value, np.float16).view(np.uint8)
    W = dequantize(qw.reshape(-1), qtype, (N, K)).double()
    x = torch.randn(3, K)
    for method in ("int8", "fp32"):
        y = quant.quant_matmul(x, qw, qtype, K, method=method)
        keep = [0, 3]
        _check({method: y[:, keep]}, x, (qw, W[keep], W[keep].abs().float()), f"{qtype} {method}")


def test_nothing_past_the_weight_is_read():
    # The weight's last byte sits just before a page the process may not touch: a read past
    # it would kill the test run.
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    for qtype, N, K in (("Q4_0", 4, 96), ("Q8_0", 3, 576), ("Q5_1", 9, 32), ("Q6_K", 2, 256), ("Q4_K", 3, 256)):
        qw = random_qweight(qtype, N, K, seed=3)
        size = -(-qw.numel() // page) * page + page
        buf = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(addr + size - page), page, 0) == 0
        guarded = torch.frombuffer(buf, dtype=torch.uint8, count=qw.numel(), offset=size - page - qw.numel())
        guarded = guarded.view(qw.shape)
        guarded.copy_(qw)
        for T, method in ((1, "int8"), (1, "fp32"), (5, "int8"), (5, "fp32")):
            x = torch.randn(T, K)
            assert torch.equal(quant.quant_matmul(x, guarded, qtype, K, method=method),
                               quant.quant_matmul(x, qw, qtype, K, method=method))
        assert torch.equal(quant.quant_embedding(torch.tensor([N - 1]), guarded, qtype, K),
                           quant.quant_embedding(torch.tensor([N - 1]), qw, qtype, K))


@pytest.mark.parametrize("qtype", BLOCK32)
def test_vocab_sized_head_at_batch_one(qtype):
    N, K = 49152, 576
    qw = random_qweight(qtype, N, K, seed=5)
    W = dequantize(qw.reshape(-1), qtype, (N, K)).double()
    x = torch.randn(1, K)
    _check({"int8": quant.quant_matmul(x, qw, qtype, K, method="int8")}, x, (qw, W, W.abs().float()), f"{qtype} head")


@pytest.mark.parametrize("qtype", TYPES)
def test_embedding_rows_are_the_dequantized_rows_exactly(qtype):
    for N, K in ((50, quant.QTYPES[qtype][1] * 3), (9, 256 * 2 + (32 if qtype in BLOCK32 else 256))):
        qw, W, _ = _case(qtype, N, K)
        ids = torch.tensor([0, N - 1, 3, 3, *torch.randint(0, N, (20,)).tolist()])
        assert torch.equal(quant.quant_embedding(ids, qw, qtype, K), W[ids].float())
    assert quant.quant_embedding(torch.empty(0, dtype=torch.int64), qw, qtype, K).shape == (0, K)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_one_and_two_threads_give_the_same_result(qtype):
    N, K = 300, 1024  # enough weight bytes that the kernel uses both threads
    qw = _case(qtype, N, K)[0]
    old = torch.get_num_threads()
    try:
        for T in (1, 5):
            x = torch.randn(T, K)
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append([quant.quant_matmul(x, qw, qtype, K, method=m) for m in ("int8", "fp32")])
            assert all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        torch.set_num_threads(old)


def test_supported_types_and_shapes():
    for qtype in BLOCK32:
        assert quant.supported(qtype, 32) and quant.supported(qtype, 576)
        assert not quant.supported(qtype, 48) and not quant.supported(qtype, 0)
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        assert quant.supported(qtype, 1536) and not quant.supported(qtype, 576)
    for qtype in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "F16", "F32", "BF16", "q4_0"):
        assert not quant.supported(qtype, 512)


def test_bad_arguments_are_refused_by_name():
    qw = _case("Q4_0", 40, 96)[0]
    x = torch.randn(2, 96)
    cases = [
        (lambda: quant.quant_matmul(x, qw.t().contiguous().t(), "Q4_0", 96), "contiguous"),
        (lambda: quant.quant_matmul(x, qw[:, :36].contiguous(), "Q4_0", 96), "bytes"),
        (lambda: quant.quant_matmul(x, qw, "Q4_1", 96), "bytes"),
        (lambda: quant.quant_matmul(x, qw.view(torch.int8), "Q4_0", 96), "uint8"),
        (lambda: quant.quant_matmul(x, qw, "Q2_K", 96), "Q2_K"),
        (lambda: quant.quant_matmul(x, qw, "Q4_0", 80), "K=80"),
        (lambda: quant.quant_matmul(x[:, :64], qw, "Q4_0", 96), "x must be"),
        (lambda: quant.quant_matmul(x.double(), qw, "Q4_0", 96), "x must be"),
        (lambda: quant.quant_matmul(torch.randn(96, 2).t(), qw, "Q4_0", 96), "x rows"),
        (lambda: quant.quant_matmul(x, qw, "Q4_0", 96, out=torch.empty(2, 41)), "out must be"),
        (lambda: quant.quant_matmul(x, qw, "Q4_0", 96, method="int4"), "method"),
        (lambda: quant.quant_embedding(torch.tensor([0, 40]), qw, "Q4_0", 96), "ids must be in"),
        (lambda: quant.quant_embedding(torch.tensor([0], dtype=torch.int32), qw, "Q4_0", 96), "int64"),
        (lambda: quant.quant_embedding(torch.tensor([0]), qw[::2], "Q4_0", 96), "contiguous"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
