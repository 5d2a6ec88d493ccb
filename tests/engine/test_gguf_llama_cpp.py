"""llama.cpp's own quantizer makes the K-quant and IQ4 mixes: an F32 GGUF written by the
tests (gguf's writer) goes through `llama_model_quantize` (llama-cpp-python, what
`llama-quantize` runs), which picks every tensor's type as for a real model. Greedy tokens,
with chunked prefill and prefix-cache hits, equal transformers reading the same file, on the
dequantized path and on the default one that keeps the blocks a kernel multiplies; the kept
path's logprobs equal the dequantized path's.

The test models' intermediate size, 288, is a multiple of 32 but not of 256: every ffn_down
(rows of 288 values) is one llama.cpp has to fall back on a 32-value block type for, as it
does for real models with such shapes, so one file holds K-quants and the older types."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.engine.gguf_factory import llama_cpp_quantize, tensor_types, write_gguf
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.engine.test_gguf import assert_greedy_parity_chunked_and_cached
from tests.engine.test_quantized_gguf import assert_kept_equals_dequantized

SHAPE = dict(hidden_size=256, intermediate_size=288)
# Each mix: (family, model overrides, types the file must hold). The types are what
# llama.cpp 0.3.36's quantizer writes for these shapes: the mix's own types, Q6_K (or Q8_0)
# where it spends more bits (the head, some attn_v and ffn_down), and the fallbacks.
MIXES = {
    "Q2_K": ("llama", {}, {"Q2_K", "Q3_K", "Q6_K", "Q4_0"}),
    "Q3_K_M": ("llama", {}, {"Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0"}),
    "Q4_K_M": ("llama", {}, {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}),
    "Q5_K_M": ("llama", {}, {"Q5_K", "Q6_K", "Q5_1", "Q8_0"}),
    "Q5_0": ("llama", {}, {"Q5_0", "Q6_K"}),
    "IQ4_XS": ("llama", {}, {"IQ4_XS", "IQ4_NL", "Q6_K"}),
    "Q6_K": ("qwen2", {}, {"Q6_K", "Q8_0"}),  # tied: the Q6_K embedding is the head too
    # Fused attn_qkv and ffn_up ([gate; up]) quantized whole; plain rotary (transformers'
    # GGUF reader knows no LongRoPE or partial rotary: see test_gguf_archs.py for those).
    "phi3-Q4_K_M": ("phi3", {"rope_scaling": None}, {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}),
}
FLOAT_TYPES = {"F32", "F16", "BF16"}


@pytest.fixture(scope="session")
def llama_cpp_mix(model_factory, tmp_path_factory):
    """llama_cpp_mix(name) -> a directory holding MIXES[name] as llama.cpp quantized it;
    one F32 source file per family, every file made once per session."""
    sources: dict[str, str] = {}
    made: dict[str, str] = {}

    def make(name: str) -> str:
        family, overrides, _ = MIXES[name]
        if family not in sources:
            out = tmp_path_factory.mktemp(f"gguf-f32-{family}")
            sources[family] = write_gguf(model_factory(family, **SHAPE, **overrides), str(out / "f32.gguf"),
                                         "F32", family)
        if name not in made:
            out = tmp_path_factory.mktemp(f"gguf-{name}")
            llama_cpp_quantize(sources[family], str(out / "model.gguf"), name.rpartition("-")[2])
            made[name] = str(out)
        return made[name]

    return make


@pytest.mark.parametrize("mix", list(MIXES))
def test_llama_cpp_mix_dequantized_and_kept_greedy_equal_transformers_chunked_and_prefix_cached(llama_cpp_mix, mix):
    model = llama_cpp_mix(mix)
    types = tensor_types(f"{model}/model.gguf")
    matrices = {name: t for name, t in types.items() if not name.endswith("norm.weight") and ".bias" not in name}
    # The quantizer really wrote the mix: its types are all there, and no matrix is left in a
    # float type (a quantizer that silently copied F32 would fail here, not pass parity).
    assert MIXES[mix][2] <= set(matrices.values()), sorted(set(matrices.values()))
    assert not FLOAT_TYPES & set(matrices.values()), matrices
    assert_greedy_parity_chunked_and_cached(model)
    # The default path keeps the blocks a kernel multiplies (Q4_0/1, Q5_0/1, Q8_0, Q4_K-Q6_K),
    # dequantizing the rest, and multiplies them in fp32: the dequantized path's tokens and
    # logprobs (within test_quantized_gguf.KEPT_LOGPROB_TOL), which are transformers' tokens.
    engine_args = dict(max_model_len=256, long_prefill_token_threshold=8, max_num_batched_tokens=24)
    llm = LLM(model, **engine_args)
    prompts = random_prompts([5, 23, 40], 1000, seed=6)
    dense = LLM(model, quantization="none", **engine_args)
    assert assert_kept_equals_dequantized(llm, dense, prompts, 10) == hf_greedy(model, prompts, 10)
    kept = {s.qtype for m in llm.engine.core.executor.worker.runner.model.modules()
            if getattr(m, "quant", None) is not None for s in m.quant.segments}
    assert kept or not {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"} & set(matrices.values())
