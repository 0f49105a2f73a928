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
    usage_of,
)
from mlxcel.server.sse import SSE_DONE, sse_template

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.llama_native.encoder import VerboseReport


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
    """One text completion of `choices` choices, as JSON or as chunks; `echo` is the prompt
    text sent ahead of each choice's output (empty: no echo)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        meta: dict[str, Any],
        *,
        want_logprobs: bool,
        echo: str = "",
        include_usage: bool = False,
        choices: int = 1,
        timings_per_token: bool = False,
        verbose: VerboseReport | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.verbose = verbose
        self.timings_per_token = timings_per_token
        self.meta = meta
        self.want_logprobs = want_logprobs
        self.echo = echo
        self.include_usage = include_usage
        self.choices = choices
        self._offsets = [len(echo)] * choices
        self._finals: list[GenerationEvent] = []
        self._text_chunk = sse_template(lambda text: self._chunk(text))

    def _chunk(
        self,
        text: str,
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        index: int = 0,
    ) -> str:
        choice = {"text": text, "finish_reason": reason, "logprobs": logprobs}
        return choice_chunk(self.meta, "text_completion", choice, extra, index)

    # ------------------------------------------------------------------ streaming

    def opening(self) -> Iterable[str]:
        if not self.echo:
            return []
        return [self._chunk(self.echo, index=i) for i in range(self.choices)]

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        if event.progress is not None:  # `return_progress`
            progress: dict[str, Any] = {"prompt_progress": event.progress.to_dict()}
            return [self._chunk("", extra=progress, index=index)]
        if self.verbose is not None and index == 0:
            self.verbose.feed(event)
        timed = event.timings is not None and not event.finished  # `timings_per_token`
        logprobs = None
        if self.want_logprobs and event.logprobs:
            logprobs = completion_logprobs(
                self.tokenizer, list(event.logprobs), self._offsets[index]
            )
        if not event.text and logprobs is None:
            return ()
        self._offsets[index] += len(event.text)
        if logprobs is None and index == 0 and not timed:
            return [self._text_chunk(event.text)]
        extra = {"timings": event.timings.to_dict()} if timed and event.timings else None
        return [self._chunk(event.text, logprobs=logprobs, extra=extra, index=index)]

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        self._finals.append(final)
        reason = final.finish_reason or "stop"
        extra = speculative_timings(final)
        if self.verbose is not None and index == 0:
            extra["__verbose"] = self.verbose.streamed(final)
        return [self._chunk("", reason, extra=extra, index=index)]

    def closing(self) -> Iterable[str]:
        if self.include_usage and self._finals:
            usage = usage_chunk(
                self.meta, "text_completion", self._finals, timings=self.timings_per_token
            )
            return [usage, SSE_DONE]
        return [SSE_DONE]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return [self._chunk("", "error", index=index), sse_error_data(error), SSE_DONE]

    # ------------------------------------------------------------------ collected

    def _choice(self, index: int, events: list[GenerationEvent]) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs:
            items = [lp for e in events for lp in e.logprobs]
            logprobs = completion_logprobs(self.tokenizer, items, len(self.echo))
        return {
            "index": index,
            "text": self.echo + "".join(e.text for e in events),
            "finish_reason": events[-1].finish_reason or "stop",
            "logprobs": logprobs,
        }

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        finals = [events[-1] for events in results]
        return {
            **envelope(self.meta, "text_completion"),
            "choices": [self._choice(i, events) for i, events in enumerate(results)],
            "usage": usage_of(finals),
            **speculative_timings(finals[0]),
            **({"__verbose": self.verbose.collected(results[0])} if self.verbose else {}),
        }
