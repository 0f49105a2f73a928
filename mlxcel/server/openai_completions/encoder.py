"""Text completions on the wire: engine events → `text_completion` bodies and chunks.

The request's life is `generation.Job`'s; this module only shapes its output. A failure
after the stream started sends the finish chunk with `finish_reason: "error"`, then an
OpenAI error event (`data: {"error": {...}}`) and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.request import GenerationEvent, TokenLogprob
from mlxcel.server.errors import APIError, sse_error_data
from mlxcel.server.generation import Encoder
from mlxcel.server.openai_common import (
    chat_logprobs,
    choice_chunk,
    envelope,
    speculative_timings,
    usage_chunk,
    usage_payload,
)
from mlxcel.server.sse import SSE_DONE, sse_template

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer


def completion_logprobs(
    tokenizer: Tokenizer, items: list[TokenLogprob], offset: int
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object, plus llama-server's `content` list."""
    tokens: list[str] = []
    text_offset: list[int] = []
    position = offset
    for item in items:
        piece = tokenizer.piece(item.token_id)
        tokens.append(piece)
        text_offset.append(position)
        position += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{tokenizer.piece(t): lp for t, lp in item.top} for item in items],
        "text_offset": text_offset,
        "content": chat_logprobs(tokenizer, items),
    }


class CompletionEncoder(Encoder):
    """One text completion (a single choice), as JSON or as chunks; `echo` is the prompt
    text sent ahead of the output (empty: no echo)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        meta: dict[str, Any],
        *,
        want_logprobs: bool,
        echo: str = "",
        include_usage: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.meta = meta
        self.want_logprobs = want_logprobs
        self.echo = echo
        self.include_usage = include_usage
        self._offset = len(echo)
        self._text_chunk = sse_template(lambda text: self._chunk(text))

    def _chunk(
        self,
        text: str,
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        choice = {"text": text, "finish_reason": reason, "logprobs": logprobs}
        return choice_chunk(self.meta, "text_completion", choice, extra)

    # ------------------------------------------------------------------ streaming

    def opening(self) -> Iterable[str]:
        return [self._chunk(self.echo)] if self.echo else []

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        logprobs = None
        if self.want_logprobs and event.logprobs:
            logprobs = completion_logprobs(self.tokenizer, list(event.logprobs), self._offset)
        if not event.text and logprobs is None:
            return ()
        self._offset += len(event.text)
        if logprobs is None:
            return [self._text_chunk(event.text)]
        return [self._chunk(event.text, logprobs=logprobs)]

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        reason = final.finish_reason or "stop"
        lines = [self._chunk("", reason, extra=speculative_timings(final))]
        if self.include_usage:
            lines.append(usage_chunk(self.meta, "text_completion", final))
        return lines

    def closing(self) -> Iterable[str]:
        return [SSE_DONE]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return [self._chunk("", "error"), sse_error_data(error), SSE_DONE]

    # ------------------------------------------------------------------ collected

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        events = results[0]
        final = events[-1]
        logprobs = None
        if self.want_logprobs:
            items = [lp for e in events for lp in e.logprobs]
            logprobs = completion_logprobs(self.tokenizer, items, len(self.echo))
        return {
            **envelope(self.meta, "text_completion"),
            "choices": [
                {
                    "index": 0,
                    "text": self.echo + "".join(e.text for e in events),
                    "finish_reason": final.finish_reason or "stop",
                    "logprobs": logprobs,
                }
            ],
            "usage": usage_payload(final.prompt_tokens, final.completion_tokens),
            **speculative_timings(final),
        }
