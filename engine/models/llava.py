"""LLaVA: a CLIP vision tower and a two-layer projector in front of our Llama-family LM.

The vision tower is small and runs once per image (its outputs are cached by image hash),
so it is plain torch with no paged KV: full bidirectional attention over the patches. Module
and parameter names follow the Hugging Face checkpoint so the loader maps names 1:1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import SINGLE_EP, SINGLE_RANK, EPGroup, TPGroup
from engine.errors import ParameterError
from engine.models.arch import ModelArch
from engine.models.llama import CausalLM

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionArch:
    """The vision half of a LLaVA config.json (the text half is a ModelArch)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    projector_act: str
    projector_bias: bool
    feature_layer: int
    select_strategy: str  # "default" drops the CLS embedding, "full" keeps it
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def num_layers_run(self) -> int:
        """Encoder layers before the selected hidden state (hidden_states[0] is the input)."""
        n = self.feature_layer if self.feature_layer >= 0 else self.num_layers + 1 + self.feature_layer
        return n


def vision_arch_from_dict(cfg: dict) -> VisionArch | None:
    """None for a text-only config."""
    if not any(a in LLAVA_ARCHITECTURES for a in cfg.get("architectures") or []):
        return None
    v = cfg["vision_config"]
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ParameterError("model", f"model: LLaVA vision tower {v.get('model_type')!r} is not supported; "
                             "supported: clip_vision_model")
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ParameterError("model", "model: a list of vision_feature_layer is not supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    act = v.get("hidden_act", "quick_gelu")
    proj_act = cfg.get("projector_hidden_act", "gelu")
    for name in (act, proj_act):
        if name not in _ACTIVATIONS:
            raise ParameterError("model", f"model: activation {name!r} is not supported; supported: "
                                 f"{sorted(_ACTIVATIONS)}")
    return VisionArch(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
        image_size=v["image_size"], patch_size=v["patch_size"],
        layer_norm_eps=v.get("layer_norm_eps", 1e-5), hidden_act=act, projector_act=proj_act,
        projector_bias=cfg.get("multimodal_projector_bias", True), feature_layer=layer,
        select_strategy=strategy, image_token_id=cfg.get("image_token_index", cfg.get("image_token_id")),
    )


def load_vision_arch(model_dir: str) -> VisionArch | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None  # a GGUF file: text only
    with open(path) as f:
        return vision_arch_from_dict(json.load(f))


class _Embeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.position_embedding = nn.Embedding(v.num_patches + 1, v.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P+1, D]
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _SelfAttention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.h = v.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        N, L, D = x.shape
        q, k, v = (p(x).view(N, L, self.h, D // self.h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # [N, H, L, D/H], no causal mask
        return self.out_proj(o.transpose(1, 2).reshape(N, L, D))


class _MLP(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = _ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = _SelfAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = _MLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionTower(nn.Module):
    """CLIP's vision transformer up to the selected layer; the later layers and the post
    layernorm are never built (LLaVA reads an inner hidden state), so their weights are
    skipped at load."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.embeddings = _Embeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # HF's spelling
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_EncoderLayer(v) for _ in range(v.num_layers_run))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P+1, D]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, v: VisionArch, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size, text_hidden, bias=v.projector_bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=v.projector_bias)
        self.act = _ACTIVATIONS[v.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaCausalLM(CausalLM):
    """The LM keeps CausalLM's parameter names (so the text weights load as for Llama); the
    vision tower and projector are replicated on every tensor-parallel rank (they are small)."""

    def __init__(self, arch: ModelArch, vision: VisionArch, ops: SimpleNamespace, max_positions: int,
                 tp: TPGroup = SINGLE_RANK, ep: EPGroup = SINGLE_EP) -> None:
        super().__init__(arch, ops, max_positions, tp, ep)
        self.vision = vision
        self.vision_tower = VisionTower(vision)
        self.multi_modal_projector = Projector(vision, arch.hidden_size)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, tokens_per_image, hidden]: one embedding per placeholder token."""
        features = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype))
        if self.vision.select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)
