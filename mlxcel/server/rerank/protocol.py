"""Request body of the rerank routes: Jina/Cohere (`documents`) or TEI (`texts`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mlxcel.server.errors import bad_request


class RerankRequest(BaseModel):
    """POST /v1/rerank and its aliases.

    `documents` (strings or `{"text": ...}` objects) selects the Jina/Cohere response with
    `top_n` and `return_documents`; `texts` selects the TEI array with `raw_scores` and
    `return_text`. `truncate: false` refuses inputs over the model's limit; `instruction`
    is the task line of generative (Qwen3-Reranker style) models.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[Any] | None = None
    texts: list[Any] | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True
    instruction: str | None = None

    @property
    def tei(self) -> bool:
        """Whether the TEI shape was asked for (a `texts` body)."""
        return self.texts is not None and self.documents is None

    def document_texts(self, max_inputs: int) -> list[str]:
        """The documents as strings (400 when missing, empty, malformed or too many)."""
        if self.documents is not None and self.texts is not None:
            raise bad_request("send either 'documents' or 'texts', not both")
        field = "texts" if self.tei else "documents"
        values = self.texts if self.tei else self.documents
        if values is None:
            raise bad_request("'documents' (or 'texts') is required")
        if not self.query:
            raise bad_request("'query' is an empty string")
        if not values:
            raise bad_request(f"'{field}' is empty")
        if len(values) > max_inputs:
            raise bad_request(
                f"'{field}' has {len(values)} items; at most {max_inputs} are allowed"
            )
        out = []
        for i, value in enumerate(values):
            text = value.get("text") if isinstance(value, dict) else value
            if not isinstance(text, str):
                raise bad_request(f"'{field}[{i}]' must be a string or an object with 'text'")
            if not text:
                raise bad_request(f"'{field}[{i}]' is an empty string")
            out.append(text)
        return out
