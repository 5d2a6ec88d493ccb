"""`pdserve make-model`: a random-weight checkpoint in Hugging Face format, with a byte-level
BPE tokenizer trained here on the corpus shipped in this package, and a chat template.

No hub is reachable from our machines, so this is the embedded default model and the source
of every model the tests load.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import torch

# ChatML with tools as Qwen2.5's template shows them: a system block listing the tools, the
# assistant's calls as <tool_call>{"name", "arguments"}</tool_call> (what the hermes parser
# reads), results as `tool` messages. Without tools it renders exactly plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}"
    "{{ '</tools>\\nTo call a tool, answer <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Shapes per preset; family-specific keys are added by `hf_config`.
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, vocab_target=1024),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048, vocab_target=2048),
    "bench": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048, vocab_target=4096),
    # GPU benchmarks: a ~1.1B-parameter shape (TinyLlama's); the embedding is padded to a
    # realistic vocabulary past what the small corpus can train.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, max_position_embeddings=4096, vocab_target=4096,
               min_vocab_size=32000),
}
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Mixture-of-experts shape for the MoE families at every preset: 8 experts, top-2 (Mixtral's
# routing; Qwen3-MoE's real models use 128 experts and top-8, too many for a tiny test model).
MOE_EXPERTS, MOE_TOP_K = 8, 2


def corpus_lines() -> list[str]:
    text = resources.files("engine.models").joinpath("corpus/en.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_target: int):
    """Byte-level BPE trained on the shipped corpus; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def hf_config(family: str, preset: str, vocab_size: int, eos_ids: list[int], pad_id: int, **overrides) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    shape = {k: v for k, v in PRESETS[preset].items() if k not in ("vocab_target", "min_vocab_size")}
    cfg = dict(
        architectures=[FAMILIES[family]],
        model_type="gemma3_text" if family == "gemma3" else family,
        vocab_size=vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        # Large enough that random logits are well separated, so greedy parity with
        # transformers is not at the mercy of float rounding on near-ties.
        initializer_range=0.1,
        tie_word_embeddings=family in ("qwen2", "qwen3", "gemma2", "gemma3"),
        eos_token_id=eos_ids[0],
        pad_token_id=pad_id,
        torch_dtype="float32",
        **shape,
    )
    if family in ("qwen3", "qwen3_moe"):
        cfg["head_dim"] = 2 * cfg["hidden_size"] // cfg["num_attention_heads"]
    if family in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if family == "mixtral":  # experts use intermediate_size and always renormalise
        cfg.update(num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
    if family == "qwen3_moe":
        # Qwen3-MoE's experts are narrower than its (dense-layer) intermediate_size.
        cfg.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, norm_topk_prob=True,
                   moe_intermediate_size=cfg["intermediate_size"] // 2, decoder_sparse_step=1,
                   mlp_only_layers=[])
    if family == "phi3":
        # Phi-3.5/4-mini's shape of rotary: LongRoPE over a pretraining length a quarter of the
        # context (rope_scaling=None for plain rotary); partial_rotary_factor may be overridden.
        cfg.update(sliding_window=None, original_max_position_embeddings=cfg["max_position_embeddings"] // 4)
    if family in ("gemma2", "gemma3"):
        cfg.update(_gemma_keys(family, cfg))
    cfg.update(overrides)
    if family == "phi3" and "rope_scaling" not in overrides:
        rot_half = int(cfg["hidden_size"] // cfg["num_attention_heads"] * cfg.get("partial_rotary_factor", 1.0)) // 2
        cfg["rope_scaling"] = longrope_scaling(rot_half)
    return cfg


def _gemma_keys(family: str, cfg: dict) -> dict:
    """Gemma 2/3's shape: heads wider than hidden / heads, scores scaled by a
    query_pre_attn_scalar other than head_dim (so a mixed-up scale shows), a short window
    so tests cross it, GeGLU; Gemma 2 soft-caps, Gemma 3 ropes its window layers with a
    local base and its global ones with a scaled one, every other layer global here (real
    checkpoints: every sixth) so a two-layer model has one of each."""
    head_dim = 2 * cfg["hidden_size"] // cfg["num_attention_heads"]
    keys = dict(head_dim=head_dim, query_pre_attn_scalar=head_dim // 2 + 8, sliding_window=16,
                hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":
        return {**keys, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    return {**keys, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def longrope_scaling(n: int) -> dict:
    """A LongRoPE rope_scaling with `n` (rotary dim / 2) factors per set, growing with the
    wavelength like real checkpoints' but jittered, so a mixed-up or misread set shows."""
    g = torch.Generator().manual_seed(1234)
    ramp = torch.linspace(0.0, 1.0, n)
    short = 1.0 + 0.5 * ramp + 0.2 * torch.rand(n, generator=g)
    long = 1.0 + 15.0 * ramp**2 + torch.rand(n, generator=g)
    return {"type": "longrope", "short_factor": [round(float(x), 4) for x in short],
            "long_factor": [round(float(x), 4) for x in long]}


def make_model(
    out_dir: str,
    preset: str = "tiny",
    family: str = "llama",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    **overrides,
) -> str:
    """Write a random-weight model directory and return its path.

    `overrides` replace config.json keys (e.g. rope_scaling, num_key_value_heads,
    tie_word_embeddings) so tests can build each family variant.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer(PRESETS[preset]["vocab_target"])
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Real checkpoints pad the embedding past the tokenizer; do the same (multiple of 64).
    vocab_size = max(-(-len(tokenizer) // 64) * 64, PRESETS[preset].get("min_vocab_size", 0))
    cfg = hf_config(family, preset, vocab_size, eos_ids, pad_id, **overrides)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Non-trivial norms catch load bugs; Gemma multiplies by 1 + weight.
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    save_kwargs = {"safe_serialization": True}
    if max_shard_bytes:
        save_kwargs["max_shard_size"] = max_shard_bytes
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "pdserve_model.json"), "w") as f:
        json.dump({"preset": preset, "family": family, "seed": seed}, f)
    return out_dir
