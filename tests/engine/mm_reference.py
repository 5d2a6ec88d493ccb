"""Images for the multimodal tests, and Hugging Face LLaVA as their greedy-parity oracle."""

from __future__ import annotations

import functools

import numpy as np
import torch


def image(seed: int, size: tuple[int, int] = (40, 48)):
    """A random RGB picture (height, width); differs per seed."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@functools.lru_cache(maxsize=2)
def hf_llava(model_dir: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(model_dir), model


def hf_llava_greedy(model_dir: str, text: str, images: list, max_new_tokens: int) -> list[int]:
    processor, model = hf_llava(model_dir)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
