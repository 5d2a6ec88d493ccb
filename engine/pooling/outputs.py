"""What the offline API answers for pooling requests (vLLM's output classes)."""

from __future__ import annotations

from dataclasses import dataclass

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


def scoring_output(out: RequestOutput) -> PoolingRequestOutput:
    """A pair's relevance: the classifier's single score (a one-label head's sigmoid, the
    yes token's probability), or its first label's probability."""
    return PoolingRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(float(out.pooled[0])))


def score_prompt(tokenizer, query: str, document: str) -> dict:
    """A (query, document) pair as one prompt, encoded as a pair the way the tokenizer does it
    for cross-encoders (its separators, if it has any; a plain concatenation otherwise)."""
    ids = tokenizer(query, document, add_special_tokens=True)["input_ids"]
    return {"prompt_token_ids": list(ids)}
