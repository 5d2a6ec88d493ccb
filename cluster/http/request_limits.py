"""Bounds on the lists and sizes a request body carries, checked before any per-item work
(docs/serving.md#limits).

A body within --max-request-body-bytes can still hold millions of stop strings, allowed token
ids or tools, each of which costs CPU per item when the request is built and, for the sampling
fields, in every engine step the request is batched in (slowing every request batched with
it). Each list is counted here, first, and past its bound the answer is a 400 naming the field
and the bound, in the microseconds it takes to count. Token id lists are bounded by the
vocabulary (a longer list repeats ids), the rest by a flag each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import ParameterError, check_int
from engine.multimodal.media import MAX_IMAGE_PIXELS

# Why these defaults: OpenAI's own API takes 128 tools and 4 stop sequences; vLLM bounds
# neither. Real clients send a handful of stop strings (chat templates' end markers, a few
# user ones) and bad words; a choice list is a classifier's labels; a JSON schema or grammar
# of 64 KiB is a large one. Each default leaves ample room for those and bounds the per-step
# cost of one request to a small multiple of an ordinary one's.
MAX_TOOLS = 128
MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 256
MAX_GUIDED_CHOICES = 1024
MAX_GUIDED_BYTES = 64 * 1024


@dataclass(frozen=True)
class RequestLimits:
    max_tools: int = MAX_TOOLS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_bad_words: int = MAX_BAD_WORDS
    max_guided_choices: int = MAX_GUIDED_CHOICES
    max_guided_bytes: int = MAX_GUIDED_BYTES  # a guided JSON schema, regex or grammar
    max_image_pixels: int = MAX_IMAGE_PIXELS  # of one image, from its header (engine.multimodal.media)

    def __post_init__(self) -> None:
        for name in ("max_tools", "max_stop_strings", "max_bad_words", "max_guided_choices", "max_guided_bytes",
                     "max_image_pixels"):
            check_int(name, getattr(self, name))

    def check(self, body, vocab_size: int, max_prompts: int) -> None:
        """Raise ParameterError naming the first field of `body` (a completions or chat
        request) past its bound. `max_prompts`: the sequences one request may hold
        (--max-pending-requests), so a batch of prompts is refused before it is tokenized."""
        _at_most("tools", getattr(body, "tools", None), self.max_tools, "--max-tools")
        stop = body.stop
        if isinstance(stop, list):
            _at_most("stop", stop, self.max_stop_strings, "--max-stop-strings")
        _at_most("bad_words", body.bad_words, self.max_bad_words, "--max-bad-words")
        _at_most("guided_choice", body.guided_choice, self.max_guided_choices, "--max-guided-choices")
        # Token ids: more entries than the vocabulary has ids can only repeat them.
        _at_most("allowed_token_ids", body.allowed_token_ids, vocab_size, "the vocabulary size")
        _at_most("logit_bias", body.logit_bias, vocab_size, "the vocabulary size")
        _at_most("stop_token_ids", body.stop_token_ids, vocab_size, "the vocabulary size")
        structured = body.structured_outputs or {}
        choice = structured.get("choice") if isinstance(structured, dict) else None
        if isinstance(choice, list):
            _at_most("structured_outputs.choice", choice, self.max_guided_choices, "--max-guided-choices")
        for field, value in (("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
                             ("guided_grammar", body.guided_grammar), ("response_format", body.response_format),
                             ("structured_outputs", body.structured_outputs)):
            if value is not None and _size(value) > self.max_guided_bytes:
                raise ParameterError(field, f"{field} is {_size(value)} bytes; at most {self.max_guided_bytes} "
                                     "are accepted (--max-guided-bytes)")
        n = max(getattr(body, "n", 1) or 1, 1)
        prompt = getattr(body, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) * n > max_prompts:
            raise ParameterError("prompt", f"the request holds {len(prompt)} prompts x n={n} = {len(prompt) * n} "
                                 f"sequences; at most {max_prompts} per request (--max-pending-requests)")


def _at_most(field: str, items, bound: int, flag: str) -> None:
    if items is not None and len(items) > bound:
        raise ParameterError(field, f"{field} has {len(items)} entries; at most {bound} are accepted ({flag})")


def _size(value) -> int:
    """Bytes of a schema or grammar as the client sent it (a string's UTF-8, an object's JSON)."""
    if isinstance(value, str):
        return len(value.encode())
    return len(json.dumps(value, separators=(",", ":")))
