"""`pdserve make-model --family llava`: a random-weight LLaVA checkpoint (CLIP vision tower +
projector + a Llama LM) with its processor, in Hugging Face format.

The tokenizer is the one `make_model` trains, plus one special token "<image>"; the processor
expands each "<image>" into one placeholder per image patch (CLS dropped, the "default"
feature strategy), so the checkpoint round-trips through AutoProcessor and
LlavaForConditionalGeneration exactly as a real one does.
"""

from __future__ import annotations

import json
import os

import torch

from engine.models.make_model import PRESETS, hf_config, train_tokenizer

IMAGE_TOKEN = "<image>"
# Content may be a string or a list of parts ({"type": "image"} / {"type": "text"}), as
# OpenAI chat messages are after the server turns image_url parts into image parts.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# CLIP shapes. tiny: 32x32 images in 8x8 patches -> 16 image tokens (tests). bench: CLIP
# ViT-B/16's image geometry (224 px, 14 px patches -> 256 image tokens) at a third of its
# width, so the encoder costs about as much as a small LM prefill (benchmarks).
VISION_PRESETS = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 image_size=32, patch_size=8, projection_dim=32, layer_norm_eps=1e-5),
    "bench": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                  image_size=224, patch_size=14, projection_dim=256, layer_norm_eps=1e-5),
}


def make_llava(out_dir: str, preset: str = "tiny", seed: int = 0, vision_preset: str = "tiny") -> str:
    """Write a random-weight LLaVA directory (weights, tokenizer, processor) and return it."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if vision_preset not in VISION_PRESETS:
        raise ValueError(f"vision_preset must be one of {sorted(VISION_PRESETS)}, got {vision_preset!r}")
    vision = VISION_PRESETS[vision_preset]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer(PRESETS[preset]["vocab_target"])
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = -(-len(tokenizer) // 64) * 64
    text = hf_config("llama", preset, vocab_size, eos_ids, pad_id)
    text.pop("architectures")
    text.pop("model_type")
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision),
        text_config=LlamaConfig(**text),
        image_token_index=image_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random norms and biases (HF initialises them to 1 / 0) catch load bugs; scaled
            # projector weights keep image features as large as text embeddings, so a wrong
            # merge changes the greedy tokens.
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embeddings" in name and "vision" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    side = vision["image_size"]
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=vision["patch_size"],
        num_additional_image_tokens=1, vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN, chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "pdserve_model.json"), "w") as f:
        json.dump({"preset": preset, "family": "llava", "vision_preset": vision_preset, "seed": seed}, f)
    return out_dir
