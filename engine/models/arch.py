"""Reading a Hugging Face config.json (or a GGUF file's metadata) into the one architecture
description our model uses."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from engine.errors import ParameterError
from engine.models.gguf_file import find_gguf, gguf_config
from engine.models.rotary import FREQ_FACTORS, LONGROPE

# HF architecture name -> family flags. Llama and Mistral share a layout; Qwen2 adds a qkv
# bias; Qwen3 adds per-head q/k RMSNorm (and keeps an explicit head_dim). The MoE families
# replace the MLP by routed experts: Mixtral's attention is Mistral's, Qwen3-MoE's is Qwen3's.
# Phi-3 fuses qkv and gate_up in its checkpoint (the loader splits them) and may rotate only
# part of each head (partial_rotary_factor) with LongRoPE scaling.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen3MoeForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Phi3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Gemma2ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "Gemma3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# A supported LM's *ForSequenceClassification (a cross-encoder): served by a pooling engine.
_CLASSIFIER = "ForSequenceClassification"
# MLP activations (the gate's, in a gated MLP): SiLU (SwiGLU) and tanh-approximated GELU (GeGLU).
SUPPORTED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", LONGROPE, FREQ_FACTORS)
# LLaVA wraps one of the LMs above; its text_config names the family by model_type.
_TEXT_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None  # sorted (key, value) pairs; hashable for the frozen dataclass
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    # Mixture of experts (num_experts == 0: a dense model). Routing: softmax over all experts
    # in fp32, top num_experts_per_tok, renormalised over those when norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotary rotates
    # Gemma 2/3: GeGLU, (1 + weight) RMSNorm in the checkpoint, norms around both sublayers'
    # outputs, embeddings times sqrt(hidden), scores scaled by query_pre_attn_scalar and
    # tanh-capped, per-layer sliding windows (Gemma 3: those layers with their own rope base).
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    norm_plus_one: bool = False  # the checkpoint stores RMSNorm weights as w - 1
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None  # None: head_dim
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    layer_windows: tuple[int, ...] = ()  # per layer: its window (0 = full attention); () = none
    local_rope_theta: float | None = None  # window layers' rope base when it differs (Gemma 3)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head are rotated (as transformers rounds it)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (0: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


def load_arch(model_dir: str) -> ModelArch:
    """`model_dir`: a Hugging Face directory, a .gguf file, or a directory holding one."""
    gguf = find_gguf(model_dir)
    if gguf is not None:
        return arch_from_dict(gguf_config(gguf))
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ParameterError("model", f"model: no config.json and no .gguf file in {model_dir!r}")
    with open(path) as f:
        cfg = json.load(f)
    return arch_from_dict(cfg)


def arch_from_dict(cfg: dict) -> ModelArch:
    """The language model's architecture (for LLaVA, its text_config's)."""
    archs = cfg.get("architectures") or []
    if "LlavaForConditionalGeneration" in archs:
        text = cfg.get("text_config") or {}
        family = _TEXT_FAMILIES.get(text.get("model_type", "llama"))
        if family is None:
            raise ValueError(f"unsupported LLaVA language model {text.get('model_type')!r}; "
                             f"supported: {sorted(_TEXT_FAMILIES)}")
        return arch_from_dict({**text, "architectures": [family]})
    classifier = next((a for a in archs if a.endswith(_CLASSIFIER)), None)
    if classifier is not None:
        # A classifier checkpoint is its LM's body with a score head (read by engine.pooling)
        # in place of the LM head: the body loads as the LM's, with no head of its own.
        lm = classifier[: -len(_CLASSIFIER)] + "ForCausalLM"
        return arch_from_dict({**cfg, "architectures": [lm], "tie_word_embeddings": True})
    name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if name is None:
        raise ValueError(
            f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    flags = SUPPORTED_ARCHITECTURES[name]
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(SUPPORTED_ACTIVATIONS)}")
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attention_bias if flags["qkv_bias"] is None else flags["qkv_bias"]
    # Qwen2's o_proj never has a bias; Llama/Qwen3 put attention_bias on o_proj too.
    o_bias = attention_bias if name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") else False
    head_dim = cfg.get("head_dim") or hidden // heads
    rope_cfg, local_theta = _split_gemma_rope(cfg) if name == "Gemma3ForCausalLM" else (cfg, None)
    theta, scaling, partial = _rope(rope_cfg, head_dim)
    sliding, windows = _windows(name, cfg)
    return ModelArch(
        architecture=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", name in _GEMMA)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=flags["qk_norm"],
        sliding_window=sliding,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        partial_rotary_factor=partial,
        hidden_act=SUPPORTED_ACTIVATIONS[act],
        layer_windows=windows,
        local_rope_theta=local_theta,
        **(_gemma_fields(cfg, hidden) if name in _GEMMA else {}),
        **_moe_fields(name, cfg),
    )


def _windows(name: str, cfg: dict) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, per-layer windows). `layer_types` (transformers >= 4.5x writes it)
    names each layer's kind; otherwise each family's rule: Mistral windows every layer,
    Qwen2/3 the layers from max_window_layers on when use_sliding_window, Gemma 2 every
    other layer (the first included), Gemma 3 all but every sliding_window_pattern-th."""
    window = cfg.get("sliding_window")
    layers = cfg["num_hidden_layers"]
    if name.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return None, ()
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    types = cfg.get("layer_types")
    if types is None:
        if name == "Gemma2ForCausalLM":
            types = ["sliding_attention" if i % 2 == 0 else "full" for i in range(layers)]
        elif name == "Gemma3ForCausalLM":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full" for i in range(layers)]
        elif name.startswith("Qwen"):
            first = cfg.get("max_window_layers", layers)
            types = ["sliding_attention" if i >= first else "full" for i in range(layers)]
        else:
            types = ["sliding_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return (int(window), windows) if any(windows) else (None, ())


def _split_gemma_rope(cfg: dict) -> tuple[dict, float]:
    """Gemma 3 ropes its global layers with rope_theta (and rope_scaling) and its window
    layers with rope_local_base_freq, unscaled; transformers >= 5 writes both as
    rope_parameters[layer type]. Returns (the config as _rope reads the global rope, the
    local base)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope type {local['rope_type']!r} for the sliding-window layers; "
                             "supported: ['default']")
        return ({**cfg, "rope_parameters": params["full_attention"], "rope_theta": None},
                float(local.get("rope_theta", 10000.0)))
    return ({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)},
            float(cfg.get("rope_local_base_freq", 10000.0)))


def _gemma_fields(cfg: dict, hidden: int) -> dict:
    # transformers multiplies by sqrt(hidden) rounded to the activation dtype; in fp32 that is
    # the fp32 value, which the model rounds again to its own dtype.
    return dict(norm_plus_one=True, sandwich_norms=True, embed_scale=float(hidden) ** 0.5,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def _moe_fields(name: str, cfg: dict) -> dict:
    """The MoE part of ModelArch, from each family's own config keys."""
    if name == "MixtralForCausalLM":
        # Mixtral's experts use intermediate_size and always renormalise over the top k.
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if name != "Qwen3MoeForCausalLM":
        return {}
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    # A layer is sparse when it is not listed as MLP-only and falls on the sparse step.
    dense = tuple(i for i in range(layers) if i in mlp_only or step <= 0 or (i + 1) % step)
    # Hub checkpoints say num_experts; transformers >= 5 writes it as num_local_experts.
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)


def _rope(cfg: dict, head_dim: int) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial_rotary_factor). Accepts both the legacy (`rope_theta` +
    `rope_scaling`, top-level `partial_rotary_factor`) and the newer (`rope_parameters`) ways a
    config describes rotary embeddings."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    merged = {**params, **scaling}
    merged.pop("rope_theta", None)
    partial = float(merged.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ValueError(f"partial_rotary_factor must be in (0, 1] and rotate an even number of the "
                         f"{head_dim} head dims, got {partial}")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    rope_type = LONGROPE if rope_type == "su" else rope_type  # Phi-3's early name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None, partial
    if rope_type == LONGROPE:
        merged = _longrope(cfg, merged, int(head_dim * partial))
    return float(theta), {"rope_type": rope_type, **merged}, partial


def _longrope(cfg: dict, s: dict, rotary_dim: int) -> dict:
    """LongRoPE's parameters made explicit as transformers derives them: the pretraining
    length (Phi-3 keeps it at the top level, which wins) and the attention factor that scales
    cos and sin, sqrt(1 + ln(factor) / ln(original)) with factor = max / original positions."""
    original = cfg.get("original_max_position_embeddings") or s.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings", 2048)
    for key in ("short_factor", "long_factor"):
        if len(s.get(key) or ()) != rotary_dim // 2:
            raise ValueError(f"rope_scaling.{key} must hold {rotary_dim // 2} factors (one per rotary "
                             f"frequency), got {len(s.get(key) or ())}")
    factor = s.get("factor") or cfg.get("max_position_embeddings", 2048) / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**s, "short_factor": tuple(s["short_factor"]), "long_factor": tuple(s["long_factor"]),
            "original_max_position_embeddings": int(original), "attention_factor": float(attention)}
