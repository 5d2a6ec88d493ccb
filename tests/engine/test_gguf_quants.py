"""GGUF dequantization: our torch block decoder against the `gguf` package's numpy one, on
data quantized by the `gguf` package itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.gguf_quants import SUPPORTED_TYPES, check_type, dequantize


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


@pytest.mark.parametrize("name", sorted(SUPPORTED_TYPES))
def test_dequantize_equals_the_gguf_reference(name):
    # Blocks with negative, positive and constant runs; 3 rows of 4 blocks.
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    x[1, :32] = 0.25
    stored, expected = _encoded(x, name)
    raw = torch.from_numpy(np.ascontiguousarray(stored).reshape(-1).view(np.uint8))
    ours = dequantize(raw, name, (3, 128))
    assert ours.shape == (3, 128)
    np.testing.assert_array_equal(ours.float().numpy(), expected.reshape(3, 128))


def test_quantized_types_are_lossy_but_close():
    """A decoder that returned zeros or garbage would still be compared above only against
    gguf's; this pins the values to the original weights too."""
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    for name, tol in (("Q8_0", 0.03), ("Q4_1", 0.3), ("Q4_0", 0.5)):
        stored, _ = _encoded(x, name)
        ours = dequantize(torch.from_numpy(stored.reshape(-1)), name, (4, 64)).numpy()
        assert np.abs(ours - x).max() < tol, name


def test_unsupported_type_names_the_type_and_the_tensor():
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight'.*Q5_K.*supported: \['BF16'"):
        check_type("Q5_K", "blk.0.attn_q.weight")


def test_size_mismatch_is_an_error():
    raw = torch.zeros(34 * 2, dtype=torch.uint8)  # two Q8_0 blocks
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, "Q8_0", (3, 32))
