"""GGUF checkpoints written by the tests (gguf's writer and quantizers): greedy tokens equal
transformers reading the same file, per quantization type and per architecture name; bad files
and paths fail with the field and the allowed values. llama.cpp's own mixes:
test_gguf_llama_cpp.py; Phi-3 and Gemma files: test_gguf_archs.py."""

from __future__ import annotations

import os
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.errors import ParameterError
from tests.engine.gguf_factory import write_gguf
from tests.engine.hf_reference import hf_greedy, random_prompts

# The dequantized path: these tests hold the file's reading and decoding to transformers,
# exactly. The default for a GGUF file keeps the blocks and multiplies them in fp32, held to
# this path's tokens and logprobs; int8 activations are judged with a near-tie margin
# (tests/engine/test_quantized_gguf.py, test_gguf_llama_cpp.py).
SMALL = dict(max_model_len=256, num_kv_blocks=64, quantization="none")


# Every supported type in one file, as llama.cpp mixes them (norms are F32): each type's
# decoding and its place in the model are checked by one engine and one transformers load.
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "BF16",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "F16", "output": "BF16"}

# K-quant and IQ4_XS blocks hold 256 values and never span rows: every matrix's rows (its
# input dimension) must be a multiple of 256.
K_SHAPE = dict(hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def gguf_file(model_factory, tmp_path_factory):
    """gguf_file(family, qtype, types=None, **model_overrides) -> a directory holding one .gguf."""
    cache: dict[tuple, str] = {}

    def make(family: str, qtype: str, types: dict | None = None, **overrides) -> str:
        key = (family, qtype, tuple(sorted((types or {}).items())), tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}")
            write_gguf(model_factory(family, **overrides), str(out / "model.gguf"), qtype, family, types=types)
            cache[key] = str(out)
        return cache[key]

    return make


def assert_greedy_parity(model: str, oracle: str | None = None, **engine_args) -> None:
    """Our engine on `model` (with `engine_args` beside the small defaults) vs transformers on
    `oracle` (default: the same file)."""
    prompts = random_prompts([5, 23], 1000, seed=3)
    expected = hf_greedy(oracle or model, prompts, 10)
    llm = LLM(model, **{**SMALL, **engine_args})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def assert_greedy_parity_chunked_and_cached(model: str, oracle: str | None = None, **engine_args) -> None:
    """As above, with prefill cut into chunks of at most 8 tokens, and a second pass that
    reads the prompts' shared prefix from the prefix cache."""
    shared = random_prompts([40], 1000, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts([3, 19], 1000, seed=5)]
    expected = hf_greedy(oracle or model, prompts, 10)
    llm = LLM(model, **{**SMALL, **engine_args}, long_prefill_token_threshold=8, max_num_batched_tokens=24)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 32 for o in outs)


def test_llama_gguf_with_every_type_greedy_equals_transformers(gguf_file):
    """llama files carry llama.cpp's q/k row interleaving; transformers undoes it on its own.
    Given as a directory holding the file."""
    assert_greedy_parity(gguf_file("llama", "F32", MIXED))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_llama_gguf_of_one_4bit_type_greedy_equals_transformers(gguf_file, qtype):
    """The coarsest types on every matrix, embedding and head included."""
    assert_greedy_parity(gguf_file("llama", qtype))


@pytest.mark.parametrize("family,qtype,overrides", [
    ("qwen2", "Q4_1", {}),  # q/k/v biases, tied embedding
    # transformers reads a qwen3 file with Qwen3Config's default head_dim (128), not the
    # file's key_length, so the test model uses that head size.
    ("qwen3", "Q8_0", {"head_dim": 128}),  # q/k RMSNorm
])
def test_each_architecture_name_equals_transformers(gguf_file, family, qtype, overrides):
    model = gguf_file(family, qtype, **overrides)
    assert_greedy_parity(os.path.join(model, "model.gguf"))  # the file itself, not its directory


def test_mistral_is_a_llama_file(model_factory, tmp_path):
    """llama.cpp writes Mistral as `llama`. transformers cannot read such a file back (it maps
    it to a `mistral` gguf-py architecture that does not exist), so the oracle is transformers'
    MistralForCausalLM on the original weights; F32 keeps them exact."""
    hf_dir = model_factory("mistral")
    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"), "F32", "llama", general_name="mistral")
    assert_greedy_parity(path, oracle=hf_dir)


def test_gguf_chat_uses_the_files_tokenizer_and_template(gguf_file):
    llm = LLM(gguf_file("llama", "F32", MIXED), **SMALL)
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "The river ran"}], add_generation_prompt=True,
                                  tokenize=False)
    assert ids == "<|im_start|>user\nThe river ran<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok.encode("<|im_end|>")) == ["<|im_end|>"]  # kept whole: special
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_missing_gguf_file_names_the_model_field(tmp_path):
    with pytest.raises(ParameterError, match="does not exist") as e:
        LLM(str(tmp_path / "nope.gguf"))
    assert e.value.field == "model"


def test_directory_with_two_gguf_files_is_ambiguous(gguf_file, tmp_path):
    src = os.path.join(gguf_file("llama", "F32", MIXED), "model.gguf")
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(src, tmp_path / name)
    with pytest.raises(ParameterError, match=r"2 \.gguf files \['a\.gguf', 'b\.gguf'\]") as e:
        LLM(str(tmp_path))
    assert e.value.field == "model"


def test_unsupported_architecture_is_named_with_the_supported_ones(model_factory, tmp_path):
    path = write_gguf(model_factory("llama"), str(tmp_path / "m.gguf"), "F32", arch="gemma")
    with pytest.raises(ParameterError, match=r"'gemma'.*supported: \['gemma2', 'gemma3', 'llama', 'phi3', 'qwen2', 'qwen3'\]"):
        LLM(path)


def test_unsupported_quant_type_names_type_and_tensor(model_factory, tmp_path):
    path = write_gguf(model_factory("llama", **K_SHAPE), str(tmp_path / "m.gguf"), "IQ2_XXS")
    with pytest.raises(ParameterError, match=r"'[\w.]+\.weight' has quantization type IQ2_XXS; "
                                             r"supported: \[.*'Q4_K'.*\]") as e:
        LLM(path, **SMALL)
    assert e.value.field == "model"


def test_missing_tensor_is_named(model_factory, tmp_path):
    path = write_gguf(model_factory("llama"), str(tmp_path / "m.gguf"), "F32",
                      skip=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        LLM(path, **SMALL)


def test_tokenizer_is_converted_once_then_read_from_the_cache(model_factory, tmp_path, monkeypatch):
    from engine.models.gguf_tokenizer import load_gguf_tokenizer

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(model_factory("llama"), str(tmp_path / "m.gguf"), "F16")
    entries = tmp_path / "cache" / "gguf-tokenizers"
    first = load_gguf_tokenizer(path)
    assert first.name_or_path == str(tmp_path) and len(os.listdir(entries)) == 1
    second = load_gguf_tokenizer(path)
    assert second.name_or_path.startswith(str(entries))
    text = "<|im_start|>user\nOnce upon a time<|im_end|>"
    assert second.encode(text) == first.encode(text)
    assert second.chat_template == first.chat_template and second.eos_token == first.eos_token
    os.utime(path, ns=(0, 0))  # a changed file is converted again, never served stale
    load_gguf_tokenizer(path)
    assert len(os.listdir(entries)) == 2


def _llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, old_len: int):
    """What llama.cpp's converter writes as rope_freqs.weight for a llama3 rope: per inverse
    frequency, 1 (short wavelengths), `factor` (long ones) or the smooth blend's divisor."""
    import math

    import numpy as np

    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_file_equals_the_hf_llama3_rope(model_factory, tmp_path):
    """A Llama-3.1-style file (rope_freqs tensor, as llama.cpp writes it) against transformers
    running the HF checkpoint with its llama3 rope_scaling (transformers' GGUF reader ignores
    rope_freqs, so the HF directory is the oracle); a small original context makes the
    scaling touch most frequencies."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_dir = model_factory("llama", rope_scaling=scaling, rope_theta=10000.0)
    import json

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = _llama3_rope_freqs(head_dim, 10000.0, 8.0, 1.0, 4.0, 64)
    assert 1.0 < len(set(freqs.tolist())) and freqs.max() == 8.0  # the factors do something
    path = write_gguf(hf_dir, str(tmp_path / "llama31.gguf"), rope_freqs=freqs)
    prompts = random_prompts([5, 40], 1000, seed=7)
    outs = LLM(path, **SMALL).generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_dir, prompts, 12)
    plain = write_gguf(hf_dir, str(tmp_path / "plain.gguf"))  # no factors: another model
    outs_plain = LLM(plain, **SMALL).generate([{"prompt_token_ids": p} for p in prompts],
                                              SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs_plain] != [o.outputs[0].token_ids for o in outs]


def test_linear_rope_scaling_from_gguf_keys(model_factory, tmp_path):
    hf_dir = model_factory("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write_gguf(hf_dir, str(tmp_path / "linear.gguf"), rope_linear=4.0)
    prompts = random_prompts([30], 1000, seed=8)
    outs = LLM(path, **SMALL).generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_dir, prompts, 12)
