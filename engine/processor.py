"""The input processor: a prompt and its params into an EngineRequest (tokenized, validated,
max_tokens resolved), once per request; and the check every engine makes of a built one."""

from __future__ import annotations

import dataclasses
import uuid

from engine.engine_request import EngineRequest
from engine.errors import ParameterError
from engine.kv_transfer_params import KVTransferParams
from engine.lora.request import LoRARequest
from engine.multimodal.features import MultiModalFeatures
from engine.multimodal.processor import FIELD as MM_FIELD
from engine.pooling.config import PoolingModel
from engine.pooling.params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output import validate as validate_structured_outputs

# What a front end is given: text, or vLLM's prompt dict ({"prompt"} or {"prompt_token_ids"},
# with "multi_modal_data" for images). Past the input processor a request is an EngineRequest.
PromptType = str | dict


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: list[int],
                 mm_processor=None, max_logprobs: int = 20, lora_check=None,
                 pooling: PoolingModel | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        # engine.multimodal.processor.MultiModalProcessor for an image model, else None.
        self.mm_processor = mm_processor
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # engine.lora.check.LoRAChecker: a request's adapter is read and checked here.
        self.lora_check = lora_check
        # A pooling model's rules (engine.pooling): it takes pooling requests only.
        self.pooling = pooling

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ParameterError("prompt", "prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self.tokenize(prompt["prompt"])
        raise ParameterError(
            "prompt", f"prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}"
        )

    def process(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> EngineRequest:
        """The one place a request is tokenized, its images processed and its default
        max_tokens resolved (the room left in the context). `prompt`: text, or vLLM's prompt
        dict ({"prompt"} or {"prompt_token_ids"}, with "multi_modal_data" for images)."""
        if not isinstance(params, SamplingParams):
            raise ParameterError("sampling_params", f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, ids, mm_features = self._tokenize_with_media(prompt)
        room = self._check_prompt(ids, pooling=pooling_params is not None)
        if pooling_params is not None:
            params = dataclasses.replace(params, max_tokens=1)  # never generates: only checks look at it
        elif params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        params = dataclasses.replace(params, _eos_token_ids=self.eos_token_ids,
                                     _bad_words_token_ids=self._bad_words_ids(params.bad_words))
        request = EngineRequest(
            request_id=request_id or uuid.uuid4().hex, prompt_token_ids=ids, sampling_params=params, prompt=text,
            lora_request=lora_request, mm_features=mm_features, kv_transfer_params=kv_transfer_params,
            priority=priority, cache_salt=cache_salt, pooling_params=pooling_params,
        )
        self._check_built(request)  # the prompt was checked above
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)  # a bad spec fails here, not in a step
        return request

    def check(self, request: EngineRequest) -> None:
        """Check a built request against this engine's limits, without tokenizing it again:
        what every engine does with a request a front end processed (a ParameterError names
        the field)."""
        if not isinstance(request, EngineRequest):
            raise ParameterError("request", f"request must be an EngineRequest, got {type(request).__name__}")
        self._check_ids(request.prompt_token_ids)
        self._check_prompt(request.prompt_token_ids, pooling=request.pooling_params is not None)
        self._check_built(request)

    def _check_built(self, request: EngineRequest) -> None:
        """`check` past its prompt's ids and length (which the caller checked)."""
        params, ids = request.sampling_params, request.prompt_token_ids
        n, room = len(ids), self.max_model_len - len(ids)
        if params.max_tokens is None:
            raise ParameterError("max_tokens", "max_tokens must be resolved by the input processor (it was None)")
        self._check_pooling(request.pooling_params)
        if params.max_tokens > room and request.pooling_params is None:
            raise ParameterError(
                "max_tokens", f"max_tokens must be <= {room} for this prompt: prompt ({n} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        kv = request.kv_transfer_params
        if kv is not None:
            if not isinstance(kv, KVTransferParams):
                raise ParameterError("kv_transfer_params", "kv_transfer_params must be KVTransferParams, "
                                     f"got {type(kv).__name__}")
            prior = kv.num_prior_output_tokens
            if not 0 <= prior < n:
                raise ParameterError("kv_transfer_params", f"kv_transfer_params.num_prior_output_tokens "
                                     f"must be in [0, {n}) for this prompt, got {prior}")
        self._check_sampling_tokens(params)
        self._check_features(request)
        if request.lora_request is not None:
            if self.lora_check is None:
                raise ParameterError("lora_request", "this engine takes no LoRA adapters")
            self.lora_check(request.lora_request)

    def _check_pooling(self, params: PoolingParams | None) -> None:
        if params is None and self.pooling is not None:
            raise ParameterError("model", f"this model is a pooling model ({self.pooling.task}): it answers "
                                 "embeddings or scores, not generated text (it runs with --runner pooling)")
        if params is None:
            return
        if self.pooling is None:
            raise ParameterError("model", "this model generates text; embeddings and scores need a pooling "
                                 "model (--runner pooling, --convert embed or classify)")
        if not isinstance(params, PoolingParams):
            raise ParameterError("pooling_params", f"pooling_params must be PoolingParams, got {type(params).__name__}")
        self.pooling.check_dimensions(params.dimensions)

    def _check_prompt(self, ids: list[int], pooling: bool = False) -> int:
        """The room the prompt leaves in the context (a ParameterError if none; a pooling
        prompt generates nothing, so it may fill the context)."""
        n = len(ids)
        if n == 0:
            raise ParameterError("prompt", "prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError("prompt", f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if n > self.max_model_len or (n == self.max_model_len and not pooling):
            raise ParameterError(
                "prompt", f"prompt is {n} tokens but max_model_len is {self.max_model_len}: the prompt must "
                f"be at most {self.max_model_len - (not pooling)} tokens"
            )
        return self.max_model_len - n

    @staticmethod
    def _check_ids(ids) -> None:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParameterError("prompt", "prompt_token_ids must be a list of integers")

    def _check_sampling_tokens(self, params: SamplingParams) -> None:
        """What needs this engine's limits: logprob counts and token ids in the vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ParameterError(name, f"{name} must be at most max_logprobs ({self.max_logprobs}), got {value}")
        V = self.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= V]
        if bad_stop:
            raise ParameterError("stop_token_ids", f"stop_token_ids must be in [0, {V}), got {bad_stop}")
        bad_bias = [t for t in (params.logit_bias or {}) if t >= V]
        if bad_bias:
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids in [0, {V}), got {bad_bias[:5]}")
        bad_allowed = [t for t in (params.allowed_token_ids or []) if t >= V]
        if bad_allowed:
            raise ParameterError("allowed_token_ids", f"allowed_token_ids must be in [0, {V}), got {bad_allowed[:5]}")

    def _bad_words_ids(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it would appear at the start of the text and after a
        space (the two ways a tokenizer usually splits it), without special tokens."""
        if not words:
            return ()
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and all(t < self.vocab_size for t in ids):
                    seqs[ids] = None
        return tuple(seqs)

    def _tokenize_with_media(self, prompt: PromptType):
        """(text, token ids, MultiModalFeatures or None). An image model runs every prompt
        through its processor, so stray placeholders without images are caught too."""
        has_media = isinstance(prompt, dict) and prompt.get(MM_FIELD) is not None
        if self.mm_processor is None:
            if has_media:
                raise ParameterError(MM_FIELD, f"{MM_FIELD}: this model is text-only and takes no images")
            return (*self.tokenize(prompt), None)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            self.tokenize({"prompt_token_ids": prompt["prompt_token_ids"]})  # validates the ids
        elif not (isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str))):
            self.tokenize(prompt)  # raises the usual error
        return self.mm_processor.process(prompt if isinstance(prompt, dict) else {"prompt": prompt})

    def _check_features(self, request: EngineRequest) -> None:
        """Images: only for an image model; each item's placeholders are image tokens of the
        prompt, and an item without pixels only comes with KV to load (a P/D decode half:
        decode never encodes). A prompt without features holds no image placeholders."""
        features, ids = request.mm_features, request.prompt_token_ids
        mm = self.mm_processor
        if features is None:
            if mm is not None and mm.image_token_id in ids:
                raise ParameterError(MM_FIELD, f"the prompt has image placeholders ({mm.image_token!r}) "
                                     f"but {MM_FIELD} has no images")
            return
        if mm is None:
            raise ParameterError(MM_FIELD, f"{MM_FIELD}: this model is text-only and takes no images")
        if not isinstance(features, MultiModalFeatures):
            raise ParameterError(MM_FIELD, f"mm_features must be MultiModalFeatures, got {type(features).__name__}")
        for item in features.items:
            if item.end > len(ids) or any(t != mm.image_token_id for t in ids[item.offset:item.end]):
                raise ParameterError(MM_FIELD, f"{MM_FIELD}: an image's placeholders [{item.offset}, {item.end}) "
                                     "are not image tokens of the prompt")
            if item.pixel_values is None and request.kv_transfer_params is None:
                raise ParameterError(MM_FIELD, f"{MM_FIELD}: an image without pixels is only for a P/D decode "
                                     "request (it comes with kv_transfer_params)")
