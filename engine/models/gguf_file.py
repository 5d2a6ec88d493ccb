"""GGUF checkpoints: which path is one, and its metadata as the config our model reads.

A model path names a GGUF checkpoint when it is a `.gguf` file, or a directory without a
config.json that holds exactly one `.gguf` file. Everything else is a Hugging Face directory.
The metadata is turned into a Hugging Face style config dict, so one validator
(`arch.arch_from_dict`) covers both formats.
"""

from __future__ import annotations

import functools
import glob
import os

import numpy as np

from engine.errors import ParameterError
from engine.models.rotary import FREQ_FACTORS

# general.architecture -> the Hugging Face class whose layout our model implements. There is
# no `mistral` GGUF architecture: llama.cpp writes Mistral models as `llama` (the same layout;
# GGUF keeps no sliding window), and gguf-py and transformers know no other spelling.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# NOTE: llama.cpp runs its `llama` architecture with interleaved (GPT-J) rotary, so its
# converter permutes the rows of each q/k head to make that equivalent to HF's half-split
# rotary. Only these architectures carry the permutation; our rotary is HF's, so the loader
# undoes it (gguf_weights.py). Qwen2/Qwen3 run half-split rotary in llama.cpp, unpermuted.
PERMUTED_QK = ("llama",)
_MISSING = object()


def find_gguf(model: str) -> str | None:
    """The GGUF file `model` names, or None for a Hugging Face directory. Raises
    ParameterError('model') for a path that does not exist, a non-GGUF file, or a
    directory with several GGUF files."""
    if not isinstance(model, str) or not os.path.exists(model):
        raise ParameterError("model", f"model {model!r} does not exist; give a Hugging Face model "
                             f"directory, a .gguf file or a directory holding one .gguf file")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ParameterError("model", f"model {model!r} is a file but not a .gguf file; give a "
                                 f".gguf file or a model directory")
        return model
    if os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        names = [os.path.basename(p) for p in found]
        raise ParameterError("model", f"model directory {model!r} holds {len(found)} .gguf files "
                             f"{names}; name one of them as the model")
    return found[0] if found else None


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
    """One reader per file and process: parsing a file's metadata takes seconds (a 49k-token
    vocabulary is ~150k small fields), and the arch, the weights and the EOS ids all need it."""
    from gguf import GGUFReader

    # Copy-on-write mapping: tensors viewed from it are writable numpy arrays, which torch
    # wraps without a copy (and without warning); the file itself is never written.
    reader = GGUFReader(path, "c")
    if reader.byte_order != "I":
        raise ParameterError("model", f"{path!r} is a byte-swapped (big-endian) GGUF file; only "
                             f"little-endian files are supported")
    return reader


def metadata(path: str, key: str, default=_MISSING):
    field = open_gguf(path).get_field(key)
    if field is None:
        if default is _MISSING:
            raise ParameterError("model", f"GGUF file {path!r} has no {key!r} metadata")
        return default
    return field.contents()


def gguf_architecture(path: str) -> str:
    arch = metadata(path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ParameterError("model", f"GGUF architecture {arch!r} of {path!r} is not supported; "
                             f"supported: {sorted(GGUF_ARCHITECTURES)}")
    return arch


def gguf_config(path: str) -> dict:
    """The file's metadata as a Hugging Face config dict (the keys arch_from_dict reads)."""
    arch = gguf_architecture(path)

    def get(key, default=_MISSING):
        return metadata(path, f"{arch}.{key}", default)

    tensors = {t.name: t for t in open_gguf(path).tensors}
    if "token_embd.weight" not in tensors:
        raise ParameterError("model", f"GGUF file {path!r} has no token_embd.weight tensor")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ParameterError("model", f"GGUF file {path!r} rotates {rotary_dim} of {head_dim} head "
                             f"dimensions; only full-head rotary is supported")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        # GGUF dimensions are innermost first: the embedding is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    scaling = _rope_scaling(path, get, tensors.get("rope_freqs.weight"), head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(path: str, get, freqs, head_dim: int) -> dict | None:
    """Rotary scaling from the file: `rope.scaling.type` linear, and Llama 3.x's `rope_freqs`
    tensor (what llama.cpp's converter writes for a llama3 rope: a divisor per frequency),
    applied as llama.cpp applies it: each inverse frequency divided by its factor."""
    kind = get("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ParameterError("model", f"GGUF rope scaling {kind!r} of {path!r} is not supported; "
                             f"supported: ['linear', 'none'] and a rope_freqs tensor")
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if freqs.tensor_type.name != "F32" or factors.size != head_dim // 2:
            raise ParameterError("model", f"GGUF rope_freqs.weight of {path!r} must be F32 with head_dim / 2 = "
                                 f"{head_dim // 2} values, got {freqs.tensor_type.name} with {factors.size}")
        if kind == "linear":
            raise ParameterError("model", f"GGUF file {path!r} has both linear rope scaling and rope_freqs")
        return {"rope_type": FREQ_FACTORS, "factors": tuple(float(f) for f in factors)}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return None


def gguf_eos_token_ids(path: str) -> list[int]:
    eos = metadata(path, "tokenizer.ggml.eos_token_id", None)
    return [] if eos is None else [int(eos)]


def hf_pretrained_args(model: str) -> tuple[str, dict]:
    """(path, kwargs) for transformers' `from_pretrained` on the same checkpoint: a GGUF file
    is named by its directory plus `gguf_file=`."""
    path = find_gguf(model)
    if path is None:
        return model, {}
    return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
