"""kernels.cpu.build's ISA levels: which one a CPU gets, what forcing one does, and every level
this machine runs built and held to the torch / float64 references (each level is its own C
code path: AVX-512, AVX2's natural-order chunks, NEON, plain C)."""

from __future__ import annotations

import math
import platform
import shutil
import subprocess

import pytest
import torch

from kernels import cpu
from kernels import reference as ref
from kernels.cpu import build, half, quant
from kernels.cpu.decode_stack import DecodeStack, StackDims, StackLayer
from tests.kernels.test_half_cpu import all_finite_values, check_product
from tests.kernels.test_quant_cpu import TYPES, _case, _check, random_qweight
from tests.kernels.test_reference import _naive_attention, _paged_inputs

ZEN4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
HASWELL = {"avx", "avx2", "fma", "f16c", "sse4_2"}
# Every level this CPU runs (x86 or aarch64), each built and held to the references below.
LEVELS = build.runnable_levels() if shutil.which("gcc") else []


def test_the_best_level_a_cpu_runs_is_chosen(monkeypatch):
    monkeypatch.delenv(build.ENV, raising=False)
    assert build.isa_level(ZEN4, "x86_64") == "avx512"
    assert build.isa_level(HASWELL, "x86_64") == "avx2"
    assert build.isa_level(HASWELL | {"avx_vnni"}, "x86_64") == "avx2_vnni"
    # AVX-512 without VNNI (Skylake-X) takes the AVX2 build.
    assert build.isa_level(ZEN4 - {"avx512_vnni"}, "x86_64") == "avx2"
    assert build.isa_level({"sse2", "sse4_2"}, "x86_64") == "portable"
    # aarch64's /proc/cpuinfo has "Features: fp asimd ... asimddp" (Graviton 2 on, Ampere
    # Altra, Apple cores): NEON with the int8 dot product; asimd alone (Cortex-A72) plain NEON.
    assert build.isa_level({"fp", "asimd", "asimddp", "i8mm"}, "aarch64") == "neon_dotprod"
    assert build.isa_level({"fp", "asimd", "asimddp"}, "arm64") == "neon_dotprod"
    assert build.isa_level({"fp", "asimd"}, "aarch64") == "neon"
    assert build.isa_level({"fp"}, "aarch64") == "portable"
    assert build.isa_level(ZEN4, "riscv64") == "portable"


def test_the_cpu_flags_are_read_from_proc_cpuinfo():
    flags = build._cpu_flags()
    if platform.machine() == "x86_64":
        assert "sse2" in flags
    assert build.runnable_levels()[-1] == "portable"


def test_a_forced_level_is_taken_when_the_cpu_runs_it(monkeypatch):
    monkeypatch.setenv(build.ENV, "avx2")
    assert build.isa_level(ZEN4, "x86_64") == "avx2"
    monkeypatch.setenv(build.ENV, "portable")
    assert build.isa_level({"fp", "asimd"}, "aarch64") == "portable"
    monkeypatch.setenv(build.ENV, "neon")
    assert build.isa_level({"fp", "asimd", "asimddp"}, "aarch64") == "neon"


@pytest.mark.parametrize("forced, flags, machine, words", [
    ("avx512", HASWELL, "x86_64", "'avx512' is not a level this CPU can run; allowed on this CPU: avx2, portable"),
    ("avx2", {"fp", "asimd"}, "aarch64", "'avx2' is not a known level; allowed on this CPU: neon, portable \\(levels "
     "known on this architecture: neon_dotprod, neon, portable\\)"),
    ("neon_dotprod", {"fp", "asimd"}, "aarch64", "'neon_dotprod' is not a level this CPU can run; allowed on this "
     "CPU: neon, portable"),
    ("neon", HASWELL, "x86_64", "'neon' is not a known level; allowed on this CPU: avx2, portable"),
    ("sse9", ZEN4, "x86_64", "'sse9' is not a known level; allowed on this CPU: avx512, avx2, portable"),
])
def test_forcing_a_level_the_cpu_cannot_run_names_the_variable_and_the_choices(monkeypatch, forced, flags, machine, words):
    monkeypatch.setenv(build.ENV, forced)
    with pytest.raises(ValueError, match=f"^{build.ENV}={words}"):
        build.isa_level(flags, machine)


def test_library_raises_for_a_bad_forced_level_instead_of_falling_back(monkeypatch):
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setenv(build.ENV, "sse9")
    with pytest.raises(ValueError, match=build.ENV):
        build.library()


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("gcc"), reason="x86 levels")
def test_levels_this_cpu_cannot_run_still_compile(tmp_path):
    # Compiled (not linked or run) with each level's flags, so their intrinsics are checked.
    for level in sorted(set(build.X86_LEVELS) - set(LEVELS)):
        flags = build.X86_LEVELS[level][1]
        src = build._SOURCES[[s.name for s in build._SOURCES].index("quant.c")]
        proc = subprocess.run(["gcc", "-O1", "-fopenmp", "-std=gnu11", *flags, "-c", str(src), "-o",
                               str(tmp_path / f"{level}.o")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{level}: {proc.stderr[-2000:]}"


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    """The kernels of one level as the ones every wrapper calls (built once, cached)."""
    monkeypatch.setattr(build, "_lib", build.load(request.param))
    monkeypatch.setattr(build, "_tried", True)
    return request.param


def test_every_quant_type_matches_the_dequantized_product(level):
    for qtype in TYPES:
        values = quant.QTYPES[qtype][1]
        N, K = (37, 608) if values == 32 else (37, 768)  # a short last chunk for the 32-value types
        case = _case(qtype, N, K)
        for T in (1, 5):
            x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
            outputs = {m: quant.quant_matmul(x, case[0], qtype, K, method=m) for m in ("int8", "fp32")}
            _check(outputs, x, case, f"{level} {qtype} T={T}")
        emb = quant.quant_embedding(torch.tensor([3, 0, 36]), case[0], qtype, K)
        assert torch.equal(emb, case[1][[3, 0, 36]].float()), f"{level} {qtype}"


def test_batch_one_products_hold_for_activations_of_any_magnitude(level):
    # At T = 1 the fp32 product of Q4_K / Q6_K / Q4_0 / Q4_1 / Q8_0 rows scales the activations
    # by powers of two (quant_t1.h, quant_t1_b32.h): tiny, huge and mixed rows must keep the
    # exact method's bound, relative to |x| @ |W|^T however small that is.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 1024, generator=g)
    spread = x * torch.pow(10.0, torch.empty(1, 1024).uniform_(-25, 25, generator=g))
    for qtype in ("Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"):
        qw, W, _ = _case(qtype, 24, 1024)
        for what, xs in (("tiny", x * 1e-36), ("huge", x * 1e30), ("spread", spread), ("zero", x * 0)):
            y = quant.quant_matmul(xs, qw, qtype, 1024, method="fp32").double()
            ref, mag = xs.double() @ W.T, xs.double().abs() @ W.abs().T
            assert ((y - ref).abs() <= 1e-5 * mag).all(), f"{level} {qtype} {what}"


def test_small_batch_products_hold_for_rows_of_any_magnitude(level):
    # From T = 2 the fp32 product of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K rows runs tiles of weight
    # rows times up to 8 activation rows, each row scaled by its own power of two
    # (quant_tile.h): rows tiny, huge, spread and zero in one batch; T past a tile and not a
    # multiple of it; rows ending 0 to 3 blocks past a 4-block quad (K = 32 has no whole quad);
    # K longer than one span of quads; N not a multiple of the tile nor of its row block.
    g = torch.Generator().manual_seed(12)
    shapes = {32: ((37, 608), (19, 576), (5, 1568), (3, 32), (2, 1024)), 256: ((37, 768), (3, 256), (5, 2560))}
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        for N, K in shapes[quant.QTYPES[qtype][1]]:
            qw, W, _ = _case(qtype, N, K)
            x = torch.randn(11, K, generator=g)
            x[1] *= 1e-36
            x[2] *= 1e30
            x[3] *= torch.pow(10.0, torch.empty(K).uniform_(-25, 25, generator=g))
            x[4] = 0
            for T in (2, 3, 8, 11):
                y = quant.quant_matmul(x[:T], qw, qtype, K, method="fp32").double()
                ref, mag = x[:T].double() @ W.T, x[:T].double().abs() @ W.abs().T
                assert ((y - ref).abs() <= 1e-5 * mag).all(), f"{level} {qtype} {N}x{K} T={T}"


def test_half_products_widen_every_value_exactly_and_match_the_upcast(level):
    # Each level widens 16-bit weights its own way: AVX-512's and F16C's conversions, plain
    # C's bit arithmetic (subnormals included).
    g = torch.Generator().manual_seed(12)
    for dtype in (torch.float16, torch.bfloat16):
        w = all_finite_values(dtype)
        assert torch.equal(half.half_matmul(torch.eye(16), w), w.float().T), f"{level} {dtype}"
        rows = torch.randn(37, 200, generator=g).to(dtype)
        for T in (1, 5):
            x = torch.randn(T, 200, generator=g)
            check_product(x, rows, half.half_matmul(x, rows), f"{level} {dtype} T={T}")


def test_attention_and_the_elementwise_kernels_match_the_references(level):
    q_lens, ctx_lens = [1, 3, 1], [33, 9, 17]
    q, kc, vc, table, qsl, seq_lens, dense = _paged_inputs(q_lens, ctx_lens, 8, 2, 64, 16, 12)
    out = cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(out, _naive_attention(q, dense, q_lens, ctx_lens, 0.125), atol=1e-5, rtol=1e-5)
    windowed = cpu.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125, sliding_window=8, softcap=5.0)
    torch.testing.assert_close(windowed, ref.paged_attention(q, kc, vc, table, qsl, seq_lens, 0.125,
                                                             sliding_window=8, softcap=5.0), atol=1e-5, rtol=1e-5)
    x, res, w = torch.randn(5, 64) * 4, torch.randn(5, 64), torch.randn(64)
    for got, want in ((cpu.rms_norm(x, w, 1e-6, res), ref.rms_norm(x, w, 1e-6, res)),
                      (cpu.silu_and_mul(x), ref.silu_and_mul(x)), (cpu.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    positions, cos_sin = torch.tensor([0, 7, 40, 3, 1]), _cos_sin(64, 64)
    qr, kr = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    torch.testing.assert_close(cpu.rotary_embedding(positions, qr, kr, cos_sin),
                               ref.rotary_embedding(positions, qr, kr, cos_sin), atol=1e-5, rtol=1e-5)
    caches = [torch.zeros(4, 4, 2, 64) for _ in range(4)]
    slots = torch.tensor([3, -1, 0, 15, 9])
    cpu.reshape_and_cache(kr, qr[:, :2], caches[0], caches[1], slots)
    ref.reshape_and_cache(kr, qr[:, :2], caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _cos_sin(positions: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def test_the_decode_stack_matches_the_layers_composed_from_the_references(level, monkeypatch):
    # Two layers (the second takes the residual from the first), a Q4_K / Q6_K qkv in three
    # segments, Q4_0 elsewhere; three requests decoding over contexts already in the cache.
    monkeypatch.setitem(quant.METHODS, "auto", quant.METHODS["fp32"])
    H, Hkv, D, hidden, inter = 4, 2, 64, 256, 512
    dims = StackDims(hidden, H, Hkv, D, inter, 1e-6, 1 / math.sqrt(D))
    seed = iter(range(100))

    def weight(qtype, n, k):
        qw = random_qweight(qtype, n, k, seed=next(seed))
        return qw, _case_dense(qw, qtype, n, k)

    layers, dense = [], []
    for _ in range(2):
        parts = [weight("Q4_K", H * D, hidden), weight("Q4_K", Hkv * D, hidden), weight("Q6_K", Hkv * D, hidden)]
        o, gu, down = weight("Q4_0", hidden, H * D), weight("Q4_0", 2 * inter, hidden), weight("Q4_0", hidden, inter)
        norms = (1 + 0.1 * torch.randn(hidden), 1 + 0.1 * torch.randn(hidden))
        starts = [0, H * D, (H + Hkv) * D]
        layers.append(StackLayer(*norms, qkv=[(s, t, p[0]) for s, t, p in zip(starts, ["Q4_K", "Q4_K", "Q6_K"], parts)],
                                 o=[(0, "Q4_0", o[0])], gate_up=[(0, "Q4_0", gu[0])], down=[(0, "Q4_0", down[0])]))
        dense.append((norms, torch.cat([p[1] for p in parts]), o[1], gu[1], down[1]))
    cos_sin, final = _cos_sin(64, D), 1 + 0.1 * torch.randn(hidden)
    q_lens, ctx_lens = [1, 1, 1], [20, 7, 33]
    _, kc, vc, table, qsl, seq_lens, _ = _paged_inputs(q_lens, ctx_lens, H, Hkv, D, 16, 8, seed=4)
    positions = (seq_lens - 1).long()
    slots = torch.stack([table[r, p // 16].long() * 16 + p % 16 for r, p in enumerate(positions.tolist())])
    x = torch.randn(3, hidden)
    caches = [(kc.clone(), vc.clone()) for _ in layers]
    got = DecodeStack(dims, layers, cos_sin, final)(x, positions, slots, table, qsl, seq_lens, caches)

    h, residual = x, torch.zeros_like(x)  # the embeddings are the first residual
    for (norms, wqkv, wo, wgu, wdown), (k_cache, v_cache) in zip(dense, [(kc.clone(), vc.clone()) for _ in layers]):
        normed, residual = ref.rms_norm(h, norms[0], dims.eps, residual)
        qkv = (normed.double() @ wqkv.T).float()
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k = ref.rotary_embedding(positions, q.reshape(3, H, D), k.reshape(3, Hkv, D), cos_sin)
        ref.reshape_and_cache(k, v.reshape(3, Hkv, D), k_cache, v_cache, slots)
        attn = ref.paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, dims.scale)
        normed, residual = ref.rms_norm((attn.reshape(3, -1).double() @ wo.T).float(), norms[1], dims.eps, residual)
        h = (ref.silu_and_mul((normed.double() @ wgu.T).float()).double() @ wdown.T).float()
    want, _ = ref.rms_norm(h, final, dims.eps, residual)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{level}")


def _case_dense(qw, qtype, n, k) -> torch.Tensor:
    from engine.models.gguf_quants import dequantize

    return dequantize(qw.reshape(-1), qtype, (n, k)).double()
