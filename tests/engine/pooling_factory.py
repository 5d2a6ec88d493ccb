"""Pooling models for tests: a made model seen as a sentence-transformers model (modules.json
and its Pooling config written beside links to its files), and transformers' pooled hidden
states as the oracle."""

from __future__ import annotations

import functools
import json
import os

import torch

_MODES = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token", "LAST": "pooling_mode_lasttoken"}


def sentence_transformers_dir(model_dir: str, out_dir: str, pooling_type: str, normalize: bool) -> str:
    """`out_dir`: the model's files (linked) plus sentence-transformers' modules.json,
    1_Pooling/config.json and, when `normalize`, a Normalize module."""
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    for name in os.listdir(model_dir):
        os.symlink(os.path.join(model_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(model_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    pooling = {"word_embedding_dimension": hidden, **{mode: False for mode in _MODES.values()},
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    pooling[_MODES[pooling_type]] = True
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    return out_dir


@functools.lru_cache(maxsize=4)
def _hf_base(model_dir: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_pooled(model_dir: str, prompt: list[int], pooling_type: str, normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers' last hidden states of one prompt (no padding), pooled the same way."""
    with torch.no_grad():
        h = _hf_base(model_dir)(torch.tensor([prompt])).last_hidden_state[0].float()  # [n, hidden]
    vec = {"LAST": h[-1], "CLS": h[0], "MEAN": h.mean(dim=0)}[pooling_type]
    if dimensions is not None:
        vec = vec[:dimensions]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0).item()


def make_classifier(model_dir: str, out_dir: str, num_labels: int = 1, seed: int = 0) -> str:
    """A random *ForSequenceClassification (a cross-encoder: the LM's body and a score head,
    `num_labels` outputs) of the made model's family and shape, with its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.architectures = [config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=4)
def _hf_classifier(model_dir: str):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_classifier_scores(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' scores of one prompt: sigmoid of a one-label head, else softmax."""
    with torch.no_grad():
        logits = _hf_classifier(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def hf_token_scores(model_dir: str, prompt: list[int], token_ids: list[int]) -> float:
    """An LLM as a yes/no reranker, as Qwen3-Reranker is used: softmax over the logits of the
    ("no", "yes") tokens at the last position; the "yes" probability."""
    from tests.engine.hf_reference import _hf_model

    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1].float()
    return torch.softmax(logits[token_ids], dim=-1)[1].item()
