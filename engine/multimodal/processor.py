"""Turn `{"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}` into token ids
with expanded placeholders plus typed features (hash, placeholder range, pixel values).

The model's Hugging Face processor (AutoProcessor) expands a text prompt's "<image>" and
preprocesses pixels. Token-id prompts are expanded here the same way: each lone image token
becomes one placeholder per encoder output embedding; a run already expanded is kept.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from engine.errors import ParameterError
from engine.models.llava import VisionArch
from engine.multimodal.features import MultiModalFeatures, MultiModalItem

FIELD = "multi_modal_data"


def image_hash(image, processor_key: str) -> str:
    """sha256 of the decoded pixels (mode, size, bytes) and the processor settings: the same
    picture sent as PNG or JPEG-identical bytes hashes the same, a different resize does not."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size}:".encode())
    h.update(image.tobytes())
    h.update(processor_key.encode())
    return h.hexdigest()


class MultiModalProcessor:
    def __init__(self, model_dir: str, vision: VisionArch, tokenizer, limit_per_prompt: int) -> None:
        from transformers import AutoProcessor

        self.hf_processor = AutoProcessor.from_pretrained(model_dir)
        self.vision = vision
        self.tokenizer = tokenizer
        self.limit = limit_per_prompt
        self.image_token_id = vision.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self._key = json.dumps(self.hf_processor.image_processor.to_dict(), sort_keys=True, default=str)

    def process(self, prompt: dict) -> tuple[str | None, list[int], MultiModalFeatures | None]:
        images = self._images(prompt.get(FIELD))
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], None
        else:
            raise ParameterError("prompt", "prompt must be a dict with 'prompt' or 'prompt_token_ids'")
        if not images:
            ids = ids if ids is not None else self.tokenizer.encode(text, add_special_tokens=True)
            if self.image_token_id in ids:
                raise ParameterError(FIELD, f"the prompt has image placeholders ({self.image_token!r}) "
                                     f"but {FIELD} has no images")
            return text, ids, None
        if ids is None:
            n = text.count(self.image_token)
            self._check_count(n, len(images))
            out = self.hf_processor(text=text, images=images, return_tensors="pt")
            ids, pixels = out["input_ids"][0].tolist(), out["pixel_values"]
        else:
            ids = self._expand(ids, len(images))
            pixels = self.hf_processor.image_processor(images, return_tensors="pt")["pixel_values"]
        return text, ids, self._features(ids, images, pixels)

    def _images(self, data) -> list:
        from PIL import Image

        if data is None:
            return []
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ParameterError(FIELD, f"{FIELD} must be a dict with the key 'image', got "
                                 f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        images = data.get("image")
        images = [images] if isinstance(images, Image.Image) else list(images or [])
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ParameterError(FIELD, f"{FIELD}['image'][{i}] must be a PIL.Image, got {type(image).__name__}")
        if len(images) > self.limit:
            raise ParameterError(FIELD, f"at most {self.limit} images per prompt (limit_mm_per_prompt), "
                                 f"got {len(images)}")
        return [image.convert("RGB") for image in images]

    def _check_count(self, placeholders: int, images: int) -> None:
        if placeholders != images:
            raise ParameterError(FIELD, f"the prompt has {placeholders} image placeholders "
                                 f"({self.image_token!r}) but {FIELD} has {images} images")

    def _expand(self, ids: list[int], num_images: int) -> list[int]:
        """A run of placeholders that is a multiple of tokens_per_image is already expanded
        (that many images); any other run is that many lone placeholders, one per image."""
        per = self.vision.tokens_per_image
        out: list[int] = []
        pos = found = 0
        for start, length in _runs(ids, self.image_token_id):
            count = length // per if length % per == 0 else length
            found += count
            out += ids[pos:start] + [self.image_token_id] * (count * per)
            pos = start + length
        self._check_count(found, num_images)
        return out + ids[pos:]

    def _features(self, ids: list[int], images: list, pixels) -> MultiModalFeatures:
        per = self.vision.tokens_per_image
        offsets = []
        for start, length in _runs(ids, self.image_token_id):
            if length % per:
                raise ParameterError(FIELD, f"image placeholders expanded to {length} tokens, expected "
                                     f"a multiple of {per}")
            offsets += range(start, start + length, per)
        self._check_count(len(offsets), len(images))
        return MultiModalFeatures(tuple(
            MultiModalItem("image", image_hash(image, self._key), offset, per, pix.contiguous())
            for offset, image, pix in zip(offsets, images, pixels)))


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    arr = np.asarray(ids) == token
    if not arr.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], arr.astype(np.int8), [0]])))
    return [(int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2])]
