"""LoRA shrink and expand: the Triton kernels (under TRITON_INTERPRET=1 on CPU) and the CPU
batched path (kernels.cpu.lora) against the torch references, which are the specification.

The cases cover what changes the kernels' grouping: no adapter tokens, one adapter over several
token tiles, adapters mixed with base-model tokens, slots that are not consecutive (the CPU path
then gathers the stacks), a single token, and a decode-like step whose tiles hold many adapters.
Sizes are off the block sizes (K = 72, N = 40, R = 12 or 72), so every mask is exercised.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.cpu import build
from kernels.cpu import lora as cpu_lora
from kernels.lora_mapping import LoRAMapping
from kernels.triton_kernels import lora as triton_lora

_MIXED = [1, -1, 0, 1, 2, -1, -1, 3, 0, 0, 2, 1, -1, 3, 3, 3, 0, -1, 2, 2, 1, 0, -1, 1, 3, 0, 2, -1, 1, 0, 0, 3,
          -1, 2, 1, 1, 0]
_CASES = {
    # name: (token slots, adapters in the stack L, rank R)
    "all_base": ([-1] * 5, 3, 12),
    "one_adapter": ([2] * 35, 3, 12),
    "mixed_with_base_rows": (_MIXED, 4, 12),
    "mixed_rank_over_one_block": (_MIXED, 4, 72),
    "non_consecutive_slots": ([5, -1, 0, 5, 3, 0, -1, 3, 3, 5, 0, -1, 5, 0, 0, 3, 5, -1], 7, 12),
    "one_token": ([4], 5, 12),
    # 20 tokens over 10 adapters: a 16-token tile holds up to 10 groups.
    "decode_many_adapters": ([7, 0, 9, 3, -1, 5, 1, 8, 2, 6, 4, 9, 0, -1, 3, 7, 2, 8, 5, 1], 10, 12),
    # More adapters than a tile has tokens: a later tile's groups start past the 16th.
    "decode_more_adapters_than_a_tile": ([t % 21 - 1 for t in range(0, 42 * 5, 5)], 20, 12),
}
K, N = 72, 40
DTYPES = [torch.float32, torch.bfloat16]


def _case(name: str, dtype: torch.dtype, seed: int = 0):
    """(x, a_stack, b_stack, s, y, mapping): inputs rounded to dtype; s is random on every row,
    base-model rows too, which the spec says expand must not read."""
    slots, L, R = _CASES[name]
    g = torch.Generator().manual_seed(seed)
    T = len(slots)
    x = torch.randn(T, K, generator=g).to(dtype)
    a_stack = (torch.randn(L, R, K, generator=g) / K**0.5).to(dtype)
    b_stack = (torch.randn(L, N, R, generator=g) / R**0.5).to(dtype)
    s = torch.randn(T, R, generator=g)
    y = torch.randn(T, N, generator=g).to(dtype)
    return x, a_stack, b_stack, s, y, LoRAMapping.build(np.array(slots))


def _shrink_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 out for every input dtype: the products of rounded inputs are exact in fp32, so the
    # kernels and the reference differ only in the order of the fp32 sums.
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def _expand_close(got: torch.Tensor, y_in: torch.Tensor, s, b_stack, mapping) -> None:
    """got (y's dtype) against the fp32 reference on the same rounded inputs: one rounding to
    y's dtype costs at most half an ulp, <= eps / 2 * |value|; fp32 sum order adds ~1e-5."""
    want = y_in.float()
    ref.lora_expand(want, s, b_stack.float(), mapping)
    eps = torch.finfo(got.dtype).eps if got.dtype != torch.float32 else 0.0
    err = (got.float() - want).abs()
    bound = eps * want.abs() + 2e-5 * (1 + want.abs())
    assert got.dtype == y_in.dtype and bool((err <= bound).all()), f"max excess {(err - bound).max()}"
    base = mapping.token_slots < 0
    assert torch.equal(got[base], y_in[base]), "a base-model row was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_CASES))
def test_triton_shrink_matches_reference(name, dtype):
    x, a_stack, _, _, _, mapping = _case(name, dtype)
    _shrink_close(triton_lora.lora_shrink(x, a_stack, mapping), ref.lora_shrink(x, a_stack, mapping))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_CASES))
def test_triton_expand_matches_reference(name, dtype):
    _, _, b_stack, s, y, mapping = _case(name, dtype, seed=1)
    got = y.clone()
    triton_lora.lora_expand(got, s, b_stack, mapping)
    _expand_close(got, y, s, b_stack, mapping)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_CASES))
def test_cpu_path_matches_reference(name, dtype):
    x, a_stack, b_stack, s, y, mapping = _case(name, dtype, seed=2)
    _shrink_close(cpu_lora.lora_shrink(x, a_stack, mapping), ref.lora_shrink(x, a_stack, mapping))
    got = y.clone()
    cpu_lora.lora_expand(got, s, b_stack, mapping)
    _expand_close(got, y, s, b_stack, mapping)


@pytest.mark.parametrize("name", list(_CASES))
def test_fused_apply_on_cpu_and_triton_is_shrink_then_expand(name):
    """lora_apply (the op the projections call): the CPU path keeps the shrink's rows grouped by
    slot, so it is checked against the reference's composition on every case."""
    x, a_stack, b_stack, _, y, mapping = _case(name, torch.float32, seed=4)
    want = y.clone()
    ref.lora_apply(want, x, a_stack, b_stack, mapping)
    for impl in (cpu_lora, triton_lora):
        got = y.clone()
        impl.lora_apply(got, x, a_stack, b_stack, mapping)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        base = mapping.token_slots < 0
        assert torch.equal(got[base], y[base])


def test_cases_cover_consecutive_and_gathered_slots():
    # The CPU path reads the stacks as a view only for consecutive slots: both kinds are tested.
    assert _case("mixed_with_base_rows", torch.float32)[-1].slot_range == (0, 4)
    assert _case("non_consecutive_slots", torch.float32)[-1].slot_range is None


def test_triton_shrink_then_expand_is_the_lora_delta():
    # End to end against an independent per-token oracle: y + B_slot (A_slot x) in float64.
    x, a_stack, b_stack, _, y, mapping = _case("mixed_with_base_rows", torch.float32, seed=3)
    got = y.clone()
    triton_lora.lora_expand(got, triton_lora.lora_shrink(x, a_stack, mapping), b_stack, mapping)
    want = y.double().clone()
    for t, slot in enumerate(mapping.token_slots.tolist()):
        if slot >= 0:
            want[t] += b_stack[slot].double() @ (a_stack[slot].double() @ x[t].double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_get_ops_exposes_lora_on_every_backend(monkeypatch):
    monkeypatch.setattr(build, "library", lambda: None)  # the C build is test_cpu.py's business
    assert kernels.get_ops("triton", "cpu").lora_shrink is triton_lora.lora_shrink
    assert kernels.get_ops("triton", "cpu").lora_expand is triton_lora.lora_expand
    assert kernels.get_ops("torch", "cpu").lora_shrink is cpu_lora.lora_shrink
    assert kernels.get_ops("torch", "cpu").lora_expand is cpu_lora.lora_expand
    assert kernels.get_ops("torch", "cuda").lora_shrink is ref.lora_shrink
    assert kernels.get_ops("torch", "cpu").lora_apply is cpu_lora.lora_apply
    assert kernels.get_ops("triton", "cpu").lora_apply is triton_lora.lora_apply


def _compile_for_hopper() -> None:
    """Compile both kernels to PTX for sm_90 as the wrappers launch them on a GPU (the
    interpreter does not check loop-carried types, dot shapes or constexpr use)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(fn, sig: dict, constexprs: dict) -> str:
        sig = {**sig, **{name: "constexpr" for name in constexprs}}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    index = {"order_ptr": "*i64", "padded_ptr": "*i64", "group_slots_ptr": "*i64"}
    for dtype, upcast in (("bf16", False), ("fp32", True)):
        shrink_sig = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "out_ptr": "*fp32", **index,
                      **{n: "i32" for n in ("num_rows", "width", "K", "R", "x_stride", "a_sl", "a_sr", "out_stride")}}
        assert ".entry" in ptx(triton_lora._shrink_kernel, shrink_sig,
                               dict(BLOCK_T=64, BLOCK_R=16, BLOCK_K=64, UPCAST=upcast))
        expand_sig = {"y_ptr": f"*{dtype}", "s_ptr": "*fp32", "b_ptr": f"*{dtype}", **index,
                      **{n: "i32" for n in ("num_rows", "width", "N", "R", "y_stride", "s_stride", "b_sl", "b_sn")}}
        assert ".entry" in ptx(triton_lora._expand_kernel, expand_sig,
                               dict(BLOCK_T=16, BLOCK_N=64, BLOCK_R=64, PRECISION="ieee" if upcast else "tf32"))
        print("compiled lora", dtype)


def test_kernels_compile_for_hopper():
    # In a subprocess: with TRITON_INTERPRET=1 set in this one, kernels cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_lora_kernels"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled lora") == 2


if __name__ == "__main__":
    _compile_for_hopper()
