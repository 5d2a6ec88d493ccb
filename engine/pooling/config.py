"""Pooling models (vLLM's `--runner pooling`): what the user asked for (`PoolingSetting`, on
the engine config) and what it resolves to for one model (`PoolingModel`).

A pooling model runs each prompt once through the same engine (prefill only) and answers the
prompt's final hidden states pooled into one vector: an embedding, or a classifier's scores.
docs/pooling.md states the rules this module implements.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.errors import ParameterError, check_choice, check_int

# vLLM's names: --runner, --convert, PoolerConfig.pooling_type.
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# The --hf-overrides keys a pooling model reads (vLLM takes any config key; here the
# architecture is read from config.json alone, so only these change anything).
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_matryoshka", "matryoshka_dimensions",
                    "is_original_qwen3_reranker", "num_labels")
_CLASSIFIER_SUFFIX = "ForSequenceClassification"
# sentence-transformers' Pooling module: mode key -> pooling_type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def _json_dict(name: str, value) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise ParameterError(name, f"{name} must be a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class PoolerConfig:
    """The user's override of the model's pooling (vLLM's PoolerConfig names); None: the
    model's own (sentence-transformers config) or the default."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None  # Matryoshka: every embedding truncated to this many

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            check_choice("pooler_config.pooling_type", self.pooling_type, POOLING_TYPES)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParameterError("pooler_config.normalize", f"pooler_config.normalize must be true or false, "
                                 f"got {self.normalize!r}")
        if self.dimensions is not None:
            check_int("pooler_config.dimensions", self.dimensions, 1)

    @classmethod
    def from_user(cls, value) -> PoolerConfig:
        """A dict, or that as JSON (the command line); pooling_type in any case."""
        value = _json_dict("pooler_config", value)
        unknown = sorted(set(value) - {"pooling_type", "normalize", "dimensions"})
        if unknown:
            raise ParameterError("pooler_config", f"pooler_config takes pooling_type, normalize and dimensions; "
                                 f"got {unknown}")
        kind = value.get("pooling_type")
        return cls(pooling_type=kind.upper() if isinstance(kind, str) else kind,
                   normalize=value.get("normalize"), dimensions=value.get("dimensions"))


@dataclass(frozen=True)
class PoolingSetting:
    """--runner, --convert, --pooler-config and --hf-overrides, checked; `overrides` is
    hf_overrides as sorted (key, value) pairs (lists as tuples: the config stays hashable)."""

    runner: str = "auto"
    convert: str = "auto"
    pooler_config: PoolerConfig = PoolerConfig()
    overrides: tuple = ()

    def __post_init__(self) -> None:
        check_choice("runner", self.runner, RUNNERS)
        check_choice("convert", self.convert, CONVERTS)
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise ParameterError("convert", f"convert={self.convert!r} makes a pooling model: it needs "
                                 "runner 'pooling' (or 'auto'), got runner 'generate'")

    @classmethod
    def from_args(cls, runner: str, convert: str, pooler_config, hf_overrides) -> PoolingSetting:
        overrides = _json_dict("hf_overrides", hf_overrides)
        unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
        if unknown:
            raise ParameterError("hf_overrides", f"hf_overrides may set {list(HF_OVERRIDE_KEYS)}; got {unknown}")
        frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()))
        return cls(runner, convert, PoolerConfig.from_user(pooler_config), frozen)

    def model_config(self, model_dir: str) -> dict:
        """The model's config.json with the overrides applied ({} for a GGUF file)."""
        path = os.path.join(model_dir, "config.json")
        cfg = {}
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        return {**cfg, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}}

    def is_pooling(self, model_dir: str) -> bool:
        """vLLM's runner resolution: 'auto' pools for a classifier checkpoint
        (*ForSequenceClassification) or when --convert asks for a pooling model."""
        if self.runner != "auto":
            return self.runner == "pooling"
        if self.convert in ("embed", "classify"):
            return True
        return any(str(a).endswith(_CLASSIFIER_SUFFIX) for a in self.model_config(model_dir).get("architectures", []))


@dataclass(frozen=True)
class PoolingModel:
    """How this engine pools, resolved once from the model's files and the user's setting."""

    task: str  # "embed" | "classify"
    pooling_type: str
    normalize: bool  # embed: L2-normalize (after truncation to `dimensions`)
    hidden_size: int
    dimensions: int | None = None  # the default truncation (pooler_config.dimensions); None: all
    matryoshka: bool = False  # whether a request may ask for `dimensions`
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it may ask for; None: any
    # classify: "score" (the checkpoint's score.weight head) or "tokens" (rows of the LM head
    # at classifier_token_ids: an LLM as a yes/no reranker).
    classifier: str | None = None
    classifier_token_ids: tuple[int, ...] = ()
    num_labels: int = 0

    def check_dimensions(self, dimensions: int | None) -> None:
        """ParameterError unless a request may ask for `dimensions` (None: the default)."""
        if dimensions is None:
            return
        if self.task != "embed" or not self.matryoshka:
            raise ParameterError("dimensions", "dimensions: this model does not support Matryoshka "
                                 "representations (its embeddings cannot be shortened)")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ParameterError("dimensions", f"dimensions must be one of {list(allowed)}, got {dimensions!r}")
        check_int("dimensions", dimensions, 1, self.hidden_size)


def sentence_transformers_pooling(model_dir: str) -> tuple[str, bool] | None:
    """(pooling_type, normalize) from a sentence-transformers model's modules.json and its
    Pooling module's config; None when the model has no modules.json."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    kinds = [m.get("type") for m in modules]
    extra = [k for k in kinds if k not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if extra:
        raise ParameterError("model", f"model: sentence-transformers modules {extra} are not supported "
                             "(Transformer, Pooling and Normalize are)")
    pooling_type = "LAST"
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is not None:
        with open(os.path.join(model_dir, pooling.get("path", "1_Pooling"), "config.json")) as f:
            modes = [key for key, on in json.load(f).items() if key.startswith("pooling_mode_") and on]
        if len(modes) != 1 or modes[0] not in _ST_MODES:
            raise ParameterError("model", f"model: pooling modes {modes} are not supported; one of "
                                 f"{sorted(_ST_MODES)} is")
        pooling_type = _ST_MODES[modes[0]]
    return pooling_type, _ST_NORMALIZE in kinds


def pooling_model(model_dir: str, setting: PoolingSetting, hidden_size: int, tokenizer=None) -> PoolingModel:
    """The model's pooling: the user's pooler_config over the model's sentence-transformers
    config over the default (last token, normalized: vLLM's for decoder embedding models).
    `tokenizer` resolves classifier_from_token (loaded here when not given)."""
    cfg = setting.model_config(model_dir)
    classifier_arch = any(str(a).endswith(_CLASSIFIER_SUFFIX) for a in cfg.get("architectures", []))
    tokens = cfg.get("classifier_from_token")
    task = setting.convert if setting.convert in ("embed", "classify") else (
        "classify" if classifier_arch or tokens else "embed")
    st = sentence_transformers_pooling(model_dir)
    user = setting.pooler_config
    pooling_type = user.pooling_type or (st[0] if st else "LAST")
    normalize = user.normalize if user.normalize is not None else (st[1] if st else True)
    dims = cfg.get("matryoshka_dimensions")
    model = dict(task=task, pooling_type=pooling_type, normalize=normalize, hidden_size=hidden_size,
                 matryoshka=bool(cfg.get("is_matryoshka") or dims),
                 matryoshka_dimensions=tuple(dims) if dims else None)
    if task == "classify":
        model.update(_classifier(model_dir, cfg, tokens, tokenizer))
    resolved = PoolingModel(**model)
    if user.dimensions is not None:
        try:
            resolved.check_dimensions(user.dimensions)
        except ParameterError as e:
            raise ParameterError("pooler_config.dimensions", f"pooler_config.{e}") from None
        resolved = PoolingModel(**{**model, "dimensions": user.dimensions})
    return resolved


def _classifier(model_dir: str, cfg: dict, tokens, tokenizer) -> dict:
    if tokens:
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
            raise ParameterError("hf_overrides", f"hf_overrides.classifier_from_token must be a list of token "
                                 f"strings, got {tokens!r}")
        if tokenizer is None:
            from engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
        ids = []
        for token in tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ParameterError("hf_overrides", f"hf_overrides.classifier_from_token: {token!r} is "
                                     f"{len(encoded)} tokens for this tokenizer; each must be one")
            ids.append(encoded[0])
        return dict(classifier="tokens", classifier_token_ids=tuple(ids), num_labels=1 if len(ids) <= 2 else len(ids))
    labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1
    if not any(str(a).endswith(_CLASSIFIER_SUFFIX) for a in cfg.get("architectures", [])):
        raise ParameterError("convert", "convert='classify' needs a *ForSequenceClassification checkpoint (its "
                             "score head) or hf_overrides.classifier_from_token (an LLM's yes/no tokens)")
    return dict(classifier="score", num_labels=int(labels))


def engine_pooling(setting: PoolingSetting, model_dir: str, hidden_size: int, tokenizer=None) -> PoolingModel | None:
    """The engine's pooling rules, or None for a generating engine."""
    return pooling_model(model_dir, setting, hidden_size, tokenizer) if setting.is_pooling(model_dir) else None
