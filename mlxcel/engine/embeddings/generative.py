"""Generative yes/no rerankers (Qwen3-Reranker style): a causal model answers "yes" or "no".

The score is the log-odds logit("yes") - logit("no") of the token after the prompt; its
sigmoid equals the softmax probability of "yes" against "no".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from mlxcel.engine.embeddings.decoder import DecoderModel
from mlxcel.engine.embeddings.rerank import Reranker, RerankOutput, RerankPlan, sigmoid
from mlxcel.engine.embeddings.tokenization import TokenizedInput, too_long
from mlxcel.engine.errors import ContextLengthError, ModelLoadError

if TYPE_CHECKING:
    from mlxcel.engine.loading.model import LoadedModel

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

PROMPT_HEAD = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: "
)
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def not_a_yes_no_reranker(name: str, yes: str = "yes", no: str = "no") -> str:
    """Why the causal model `name` cannot rank (one line, naming what ranking needs)."""
    return (
        f"{name}: the vocabulary has no single {yes!r}/{no!r} tokens; not a yes/no reranker "
        "(ranking needs a cross-encoder, an embedding encoder or a yes/no decoder such as "
        "Qwen3-Reranker)"
    )


def check_yes_no_vocabulary(path: Path, *, yes: str = "yes", no: str = "no") -> None:
    """Refuse (ModelLoadError) a causal model whose vocabulary lacks single `yes`/`no` tokens,
    reading only a GGUF header or a directory's `tokenizer.json` (no weights). Vocabularies
    it cannot read that way (a SentencePiece model file) pass; loading checks them."""
    vocabulary = _vocabulary(path)
    if vocabulary is not None and not {yes, no} <= vocabulary:
        raise ModelLoadError(not_a_yes_no_reranker(path.stem if path.is_file() else path.name))


def _vocabulary(path: Path) -> set[str] | None:
    """The token strings of the model at `path` (a GGUF file or a model directory), or None."""
    if path.is_file():
        from mlxcel.engine.loading.gguf import read_gguf_header

        tokens = read_gguf_header(path).metadata.get("tokenizer.ggml.tokens")
        return {str(t) for t in tokens} if tokens is not None else None
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return set(Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True))


class GenerativeReranker(Reranker):
    """A causal model judging each (query, document) pair; the document is cut when too long."""

    kind = "generative"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        yes: str = "yes",
        no: str = "no",
        head: str = PROMPT_HEAD,
        tail: str = PROMPT_TAIL,
    ) -> None:
        self.model = DecoderModel(loaded)
        self.name = self.model.name
        self.path = self.model.path
        self.max_length = self.model.max_length
        self.head = head
        self.tail = tail
        ids = [self.model.tokenizer.token_id(word) for word in (yes, no)]
        if ids[0] is None or ids[1] is None:
            raise ModelLoadError(not_a_yes_no_reranker(self.name, yes, no))
        self.yes_id, self.no_id = int(ids[0]), int(ids[1])

    def prepare(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> RerankPlan:
        head_text = self.head.format(instruction=instruction or DEFAULT_INSTRUCTION, query=query)
        tok = self.model.tokenizer
        head, tail = tok.plain_ids([head_text, self.tail])
        room = self.max_length - len(head) - len(tail)
        if room < 1:
            raise ContextLengthError(
                f"the query and prompt take {len(head) + len(tail)} tokens, leaving no room "
                f"for a document in the model's {self.max_length}-token limit"
            )
        items = []
        for i, doc in enumerate(tok.plain_ids(list(documents))):
            cut = len(doc) > room
            if cut and not truncate:
                raise too_long(i, len(head) + len(doc) + len(tail), self.max_length, "document")
            items.append(TokenizedInput(tuple(head + doc[:room] + tail), None, cut))
        return RerankPlan(items=items, documents=len(documents))

    def forward(self, batch: Sequence[TokenizedInput]) -> list[float]:
        logits = self.model.last_logits(batch).astype(mx.float32)
        scores = logits[:, self.yes_id] - logits[:, self.no_id]
        mx.eval(scores)
        return [float(x) for x in np.array(scores)]

    def finish(self, plan: RerankPlan, outputs: list[float]) -> RerankOutput:
        items: list[TokenizedInput] = plan.items
        return RerankOutput(
            scores=list(outputs),
            relevance=[sigmoid(x) for x in outputs],
            token_counts=[len(x) for x in items],
            truncated=[x.truncated for x in items],
        )
