"""Request and response bodies of the pooling routes: OpenAI's embeddings, vLLM's score, and
the Jina/Cohere rerank shape (docs/pooling.md#endpoints)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict


class _PoolingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as the other routes: unknown fields are ignored

    model: str
    user: str | None = None
    request_id: str | None = None
    priority: int = 0

    def param(self, field: str) -> str:
        """The request field a ParameterError's engine-side `field` came from."""
        return {"prompt": self.prompt_field, "pooling_params": self.prompt_field}.get(field, field)

    prompt_field: ClassVar[str] = "input"


class EmbeddingRequest(_PoolingBody):
    """OpenAI's: `input` a string, strings, token ids or lists of token ids; vLLM's
    `normalize` besides."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None

    def inputs(self) -> list[str | list[int]]:
        """The prompts; an empty list is one empty prompt, which the engine's check rejects."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            return [[]]
        if all(isinstance(t, int) for t in x):
            return [list(x)]
        return list(x)


class ScoreRequest(_PoolingBody):
    """vLLM's /v1/score: text_1 (one, or one per text_2) against each text_2."""

    text_1: str | list[str]
    text_2: str | list[str]
    prompt_field: ClassVar[str] = "text_2"

    def texts(self) -> tuple[list[str], list[str]]:
        return ([self.text_1] if isinstance(self.text_1, str) else list(self.text_1),
                [self.text_2] if isinstance(self.text_2, str) else list(self.text_2))


class RerankRequest(_PoolingBody):
    """Jina's and Cohere's /rerank: the documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    prompt_field: ClassVar[str] = "documents"


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
