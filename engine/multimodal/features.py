"""The typed multimodal part of a request: one item per image, in prompt order."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


# eq=False: items hold tensors, whose == is elementwise; an item is equal only to itself.
@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image: where its placeholder tokens sit and what the encoder needs.

    `mm_hash` covers the image bytes and the processor settings, so equal hashes mean equal
    encoder outputs: it keys the encoder cache and the prefix-cache block hashes.
    """

    modality: str
    mm_hash: str
    offset: int  # first placeholder token in the prompt
    length: int  # placeholder tokens == encoder output embeddings
    pixel_values: torch.Tensor | None  # [3, H, W]; None once only the KV is needed (P/D decode)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        return self.offset < stop and start < self.end


@dataclass(frozen=True)
class MultiModalFeatures:
    items: tuple[MultiModalItem, ...]

    def __len__(self) -> int:
        return len(self.items)

    def without_pixels(self) -> MultiModalFeatures:
        """The features a P/D decode side gets: placeholders and hashes, never pixels."""
        return MultiModalFeatures(tuple(replace(item, pixel_values=None) for item in self.items))

    def hashes_in(self, start: int, stop: int) -> tuple[str, ...]:
        """Hashes of the items whose placeholders overlap tokens [start, stop)."""
        return tuple(item.mm_hash for item in self.items if item.overlaps(start, stop))
