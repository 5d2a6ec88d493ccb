"""What the offline API answers for pooling requests (vLLM's output classes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ParameterError
from engine.outputs import RequestOutput


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label: sigmoid for one label, softmax over several


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """`outputs`: EmbeddingOutput (LLM.embed), ClassificationOutput (LLM.classify) or
    ScoringOutput (LLM.score)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    finished: bool = True


def embedding_output(out: RequestOutput) -> PoolingRequestOutput:
    return PoolingRequestOutput(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.pooled.tolist()))


def classification_output(out: RequestOutput) -> PoolingRequestOutput:
    return PoolingRequestOutput(out.request_id, out.prompt_token_ids, ClassificationOutput(out.pooled.tolist()))


def score_prompt(tokenizer, query: str, document: str) -> dict:
    """A (query, document) pair as one prompt, encoded as a pair the way the tokenizer does it
    for cross-encoders (its separators, if it has any; a plain concatenation otherwise)."""
    ids = tokenizer(query, document, add_special_tokens=True)["input_ids"]
    return {"prompt_token_ids": list(ids)}


def score_inputs(tokenizer, task: str, firsts: list[str], seconds: list[str]
                 ) -> tuple[list[dict | str], Callable[[list[torch.Tensor]], list[float]]]:
    """The prompts that score each (firsts[i], seconds[i]) pair (firsts may be one text for
    all) and how their pooled outputs become the scores. A classifier reads each pair as one
    prompt (its first score); an embedding model embeds each text once and a pair's score is
    the cosine similarity of its two embeddings (vLLM's score for embedding models)."""
    if task == "classify":
        if not all(isinstance(t, str) for t in (*firsts, *seconds)):
            raise ParameterError("data_2", "a classify model scores text pairs (each encoded as the tokenizer "
                                 "encodes a pair): give strings")
        pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)
        return [score_prompt(tokenizer, q, d) for q, d in pairs], lambda pooled: [float(p[0]) for p in pooled]
    k = len(firsts)

    def cosines(pooled: list[torch.Tensor]) -> list[float]:
        a, b = pooled[:k], pooled[k:]
        return [torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=0).item()
                for x, y in zip(a * len(b) if k == 1 else a, b)]

    return [*firsts, *seconds], cosines
