"""GGUF dequantization: our torch block decoder against the `gguf` package's numpy one, bit
for bit, on data quantized by the `gguf` package itself and on random blocks of every type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import ParameterError
from engine.models.gguf_quants import SUPPORTED_TYPES, check_type, dequantize
from tests.engine.gguf_factory import GGUF_QUANTIZES, random_blocks

BLOCK_TYPES = sorted(set(SUPPORTED_TYPES) - {"F32", "F16", "BF16"})


def _encoded(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes, the gguf package's own decoding of them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    if name == "F32":
        return x.view(np.uint8), x
    if name == "F16":
        h = x.astype(np.float16)
        return h.view(np.uint8), h.astype(np.float32)
    q = quantize(x, GGMLQuantizationType[name])
    return q, gguf_dequantize(q, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", ["F32", "F16", *GGUF_QUANTIZES])
def test_dequantize_equals_the_gguf_reference(name):
    # Blocks with negative, positive and constant runs; 3 rows of 4 blocks.
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    x[1, :32] = 0.25
    stored, expected = _encoded(x, name)
    raw = torch.from_numpy(np.ascontiguousarray(stored).reshape(-1).view(np.uint8))
    ours = dequantize(raw, name, (3, 128))
    assert ours.shape == (3, 128)
    np.testing.assert_array_equal(ours.float().numpy(), expected.reshape(3, 128))


@pytest.mark.parametrize("rows,blocks_per_row", [(1, 1), (3, 2), (16, 5)])
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_random_blocks_decode_bit_exactly_as_gguf(name, rows, blocks_per_row):
    """Every bit pattern of the integer fields, and fp16 scales of any sign and exponent
    (subnormals too): not only what a quantizer would write."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    t = GGMLQuantizationType[name]
    values, _ = GGML_QUANT_SIZES[t]
    seed = BLOCK_TYPES.index(name) * 100 + rows
    blocks = random_blocks(name, rows * blocks_per_row, np.random.default_rng(seed))
    expected = torch.from_numpy(gguf_dequantize(blocks, t).reshape(rows, blocks_per_row * values))
    assert torch.isfinite(expected).all()
    ours = dequantize(torch.from_numpy(blocks.reshape(-1)), name, (rows, blocks_per_row * values))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected)


def test_quantized_types_are_lossy_but_close():
    """A decoder that returned zeros or garbage would still be compared above only against
    gguf's; this pins the values to the original weights too."""
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    for name, tol in (("Q8_0", 0.03), ("Q5_1", 0.1), ("Q5_0", 0.15), ("Q4_1", 0.3), ("Q4_0", 0.5)):
        stored, _ = _encoded(x, name)
        ours = dequantize(torch.from_numpy(stored.reshape(-1)), name, (4, 64)).numpy()
        assert np.abs(ours - x).max() < tol, name


def test_unsupported_type_names_the_type_the_tensor_and_the_supported_ones():
    with pytest.raises(ParameterError, match=r"'blk\.0\.attn_q\.weight'.*IQ2_XXS.*supported: \['BF16'.*'Q4_K'") as e:
        check_type("IQ2_XXS", "blk.0.attn_q.weight")
    assert e.value.field == "model"


def test_size_mismatch_is_an_error():
    raw = torch.zeros(34 * 2, dtype=torch.uint8)  # two Q8_0 blocks
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, "Q8_0", (3, 32))


def test_rows_must_be_whole_blocks():
    """One Q4_K block's bytes, but as two 128-value rows: a block never spans rows."""
    raw = torch.from_numpy(random_blocks("Q4_K", 1, np.random.default_rng(0)).reshape(-1))
    with pytest.raises(ValueError, match="Q4_K.*whole 256-value blocks"):
        dequantize(raw, "Q4_K", (2, 128))
