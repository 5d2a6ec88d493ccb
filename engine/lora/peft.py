"""PEFT LoRA adapters on disk: read, check against the model and the limits, and lay out
for our fused projections.

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` (or `.bin`) with `...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. Our layers fuse q/k/v and gate/up, so each Hugging
Face module becomes a slice of one of our projections (`projection_slices`). The scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B once, here.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from engine.errors import ParameterError
from engine.lora.config import LoRAConfig
from engine.models.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class Target:
    """Where one Hugging Face module's adapter lands: slice `index` of our projection `proj`,
    writing output features [out_start, out_start + out_len) from `in_features` inputs."""

    proj: str
    index: int
    out_start: int
    out_len: int
    in_features: int


# Slices per projection: the stacks reserve max_lora_rank columns for each.
NUM_SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def projection_slices(arch: ModelArch) -> dict[str, Target]:
    """Hugging Face module name -> its place in our projections (Phi-3 names its fused
    modules as we do; every other family has them apart)."""
    H, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    return {
        "q_proj": Target("qkv_proj", 0, 0, q, H),
        "k_proj": Target("qkv_proj", 1, q, kv, H),
        "v_proj": Target("qkv_proj", 2, q + kv, kv, H),
        "qkv_proj": Target("qkv_proj", 0, 0, q + 2 * kv, H),
        "o_proj": Target("o_proj", 0, 0, H, q),
        "gate_proj": Target("gate_up_proj", 0, 0, inter, H),
        "up_proj": Target("gate_up_proj", 1, inter, inter, H),
        "gate_up_proj": Target("gate_up_proj", 0, 0, 2 * inter, H),
        "down_proj": Target("down_proj", 0, 0, H, inter),
    }


@dataclass
class LoRAAdapter:
    """An adapter read into host memory: per (layer, our projection), its slices as
    (Target, A [r, in], B [out_len, r] with the scaling folded in)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], list[tuple[Target, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {proj for _, proj in self.weights}


def read_config(path: str, config: LoRAConfig) -> dict:
    """adapter_config.json, checked for what we support; ParameterError names the field."""
    if not os.path.isdir(path):
        raise ParameterError("lora_path", f"lora_path {path!r} is not a directory (a PEFT adapter directory "
                             f"holds {CONFIG_FILE} and {WEIGHT_FILES[0]})")
    cfg_file = os.path.join(path, CONFIG_FILE)
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ParameterError("lora_path", f"cannot read {cfg_file}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ParameterError("lora_path", f"{cfg_file} is not a LoRA adapter config (peft_type "
                             f"{cfg.get('peft_type') if isinstance(cfg, dict) else None!r})")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ParameterError("r", f"{cfg_file}: r must be an integer >= 1, got {r!r}")
    if r > config.max_lora_rank:
        raise ParameterError("max_lora_rank", f"adapter {path!r} has rank r={r} but max_lora_rank is "
                             f"{config.max_lora_rank}: start the engine with max_lora_rank >= {r}")
    for name, ok, why in (
        ("use_dora", not cfg.get("use_dora"), "DoRA adapters are not supported"),
        ("bias", cfg.get("bias", "none") == "none", "adapters that train biases are not supported"),
        ("modules_to_save", not cfg.get("modules_to_save"), "adapters with fully trained modules "
         "(modules_to_save: an embedding or LM head) are not supported"),
        ("rank_pattern", not cfg.get("rank_pattern") and not cfg.get("alpha_pattern"),
         "per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported"),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D layers) is not supported"),
    ):
        if not ok:
            raise ParameterError(name, f"{cfg_file}: {why}")
    return cfg


def scaling(cfg: dict) -> float:
    r, alpha = cfg["r"], cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _open_weights(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise ParameterError("lora_path", f"adapter {path!r} has no weights ({' or '.join(WEIGHT_FILES)})")


def load_adapter(name: str, path: str, arch: ModelArch, config: LoRAConfig) -> LoRAAdapter:
    """Read and check a PEFT adapter for this model: its rank against max_lora_rank, every
    module it trains against the model's (ParameterError naming the field otherwise)."""
    cfg = read_config(path, config)
    r, scale = cfg["r"], scaling(cfg)
    targets = projection_slices(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _open_weights(path).items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in targets:
            raise ParameterError("target_modules", f"adapter {path!r} trains {key!r}, which this model cannot "
                                 f"adapt (supported: {sorted(targets)} of the decoder layers)")
        layer, module = int(m.group(1)), m.group(3)
        if layer >= arch.num_layers or (targets[module].proj in ("gate_up_proj", "down_proj")
                                        and arch.is_moe_layer(layer)):
            raise ParameterError("target_modules", f"adapter {path!r} trains {key!r}, but layer {layer} of this "
                                 f"{arch.num_layers}-layer model has no such module")
        pairs.setdefault((layer, module), {})[m.group(4)] = tensor
    adapter = LoRAAdapter(name, path, r)
    for (layer, module), ab in sorted(pairs.items()):
        t = targets[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise ParameterError("lora_path", f"adapter {path!r}: layer {layer} {module} has lora_"
                                 f"{'A' if a is None else 'B'} missing")
        if tuple(a.shape) != (r, t.in_features) or tuple(b.shape) != (t.out_len, r):
            raise ParameterError("lora_path", f"adapter {path!r}: layer {layer} {module} has A {tuple(a.shape)} "
                                 f"and B {tuple(b.shape)}, this model needs ({r}, {t.in_features}) and "
                                 f"({t.out_len}, {r}): an adapter of another model?")
        adapter.weights.setdefault((layer, t.proj), []).append((t, a.float(), b.float() * scale))
    if not adapter.weights:
        raise ParameterError("target_modules", f"adapter {path!r} has no LoRA weights")
    return adapter
