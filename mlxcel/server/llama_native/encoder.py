"""Native /completion and /infill answers on the wire: llama-server's result objects.

The request's life (several prompts run at once, one sequence each) is `generation.Job`'s;
this module only shapes its output as llama-server does (see
`shared/spec/llama-server-samples.json`): JSON result objects, or `data:` chunks ending
with each sequence's full result. A failure mid-stream is one `data: {"error": {...}}`
event, and the stream ends there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, TokenLogprob
from mlxcel.server.errors import APIError, sse_error_data
from mlxcel.server.generation import Encoder
from mlxcel.server.llama_native.protocol import (
    NativeCompletionRequest,
    generation_settings,
    project_fields,
)
from mlxcel.server.openai_common import chat_logprobs
from mlxcel.server.sse import sse_data

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.state import ServerState


def _stop_type(
    final: GenerationEvent, request: GenerationRequest, text_of: Callable[[], str]
) -> tuple[str, str]:
    """(`stop_type`, `stopping_word`) as llama-server reports them.

    The engine ends a sequence with `stop` on an end-of-generation token, a stop string or
    a loop; a stop string is told apart by finding it in the generated text (`text_of()`,
    the decoded tokens, the stop string included), unless the engine names it.
    """
    if final.finish_reason == "length":
        return "limit", ""
    word = getattr(final, "stop_word", None)
    if word:
        return "word", str(word)
    if request.stop:
        text = text_of()
        ends = [(text.find(s) + len(s), -len(s), s) for s in request.stop if s in text]
        if ends:
            return "word", min(ends)[2]
    return "eos", ""


class NativeEncoder(Encoder):
    """The answer to one native request of `len(requests)` prompts."""

    def __init__(
        self,
        state: ServerState,
        body: NativeCompletionRequest,
        requests: list[GenerationRequest],
        model: str,
        *,
        single: bool,
    ) -> None:
        assert state.tokenizer is not None
        self.state = state
        self.tokenizer: Tokenizer = state.tokenizer
        self.native = body
        self.requests = requests
        self.model = model
        self.single = single
        self.slots = [-1] * len(requests)
        self._looked = [False] * len(requests)
        self._predicted = [0] * len(requests)
        self._progressed = [False] * len(requests)

    def observe(self, index: int, event: GenerationEvent) -> None:
        """Note the slot serving sequence `index` (the engine may name it on any event;
        else one snapshot look at its first event, best effort)."""
        if event.slot >= 0:
            self.slots[index] = event.slot
            return
        if self.slots[index] >= 0 or self._looked[index] or event.finished:
            return
        self._looked[index] = True  # the job holds a slot while it emits: one look is enough
        engine = self.state.engine
        if engine is None:
            return
        request_id = self.requests[index].request_id
        for slot in engine.snapshot().slots:
            if slot.request_id == request_id:
                self.slots[index] = slot.id
                return

    # ------------------------------------------------------------------ streaming

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        request = self.requests[index]
        if event.progress is not None:  # asked for with `return_progress`
            self._progressed[index] = True
            return [self._progress_chunk(index, event.progress.to_dict())]
        lines: list[str] = []
        if request.progress and not self._progressed[index]:
            # An engine that reports no prefill steps: one report, the prompt processed.
            self._progressed[index] = True
            n = len(request.prompt_tokens)
            done = {"total": n, "cache": 0, "processed": n, "time_ms": 0.0}
            lines.append(self._progress_chunk(index, done))
        self._predicted[index] += len(event.token_ids)
        chunk: dict[str, Any] = {
            "index": index,
            "content": event.text,
            "tokens": list(event.token_ids),
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": self._predicted[index],
            "tokens_evaluated": len(request.prompt_tokens),
        }
        if event.timings is not None and request.timings_per_token and not event.finished:
            chunk["timings"] = event.timings.to_dict()
        if self.native.n_probs > 0 and not event.finished:
            chunk["completion_probabilities"] = self._probabilities(list(event.logprobs))
        lines.append(sse_data(chunk))
        return lines

    def _progress_chunk(self, index: int, progress: dict[str, Any]) -> str:
        """A prefill progress chunk (llama-server's partial result with `prompt_progress`)."""
        return sse_data(
            {
                "index": index,
                "content": "",
                "tokens": [],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": 0,
                "tokens_evaluated": len(self.requests[index].prompt_tokens),
                "prompt_progress": progress,
            }
        )

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        return [sse_data(self._result(index, [], final, content=""))]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return [sse_error_data(APIError(error.status, error.message, "server_error"))]

    # ------------------------------------------------------------------ collected

    def body(self, results: list[list[GenerationEvent]]) -> Any:
        objects = [self._result(i, events, events[-1]) for i, events in enumerate(results)]
        return objects[0] if self.single else objects

    def _result(
        self,
        index: int,
        events: list[GenerationEvent],
        final: GenerationEvent,
        *,
        content: str | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """The full llama-server result object (also the last event of a stream)."""
        tokenizer, body = self.tokenizer, self.native
        request = self.requests[index]
        text = "".join(e.text for e in events) if content is None else content
        ids = [t for e in events for t in e.token_ids] if token_ids is None else token_ids
        stop_type, stopping_word = _stop_type(
            final, request, lambda: tokenizer.decode(ids, skip_special=True)
        )
        n_predict = body.token_limit()
        out: dict[str, Any] = {
            "index": index,
            "content": text,
            "tokens": ids if body.return_tokens and content is None else [],
            "id_slot": self.slots[index],
            "stop": True,
            "model": self.model,
            "tokens_predicted": final.completion_tokens,
            "tokens_evaluated": final.prompt_tokens,
            "generation_settings": generation_settings(
                request.sampling,
                settings=self.state.settings,
                n_predict=-1 if n_predict is None else n_predict,
                stream=body.stream,
                n_probs=body.n_probs,
                stop=request.stop,
                ignore_eos=request.ignore_eos,
                eog_tokens=tokenizer.eos_token_ids,
                post_sampling_probs=bool(body.post_sampling_probs),
            ),
            "prompt": tokenizer.decode(request.prompt_tokens),
            "has_new_line": "\n" in text,
            "truncated": self._filled_context(final, request),
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "tokens_cached": max(0, final.prompt_tokens + final.completion_tokens - 1),
            "timings": final.timings.to_dict() if final.timings is not None else {},
        }
        if body.n_probs > 0 and content is None:
            out["completion_probabilities"] = self._probabilities(
                [lp for e in events for lp in e.logprobs]
            )
        return project_fields(out, body.response_fields) if body.response_fields else out

    def _probabilities(self, items: list[TokenLogprob]) -> list[dict[str, Any]]:
        """`completion_probabilities`: log-probabilities (`logprob`, `top_logprobs`), or with
        `post_sampling_probs` the sampled distribution's probabilities (`prob`, `top_probs`)."""
        if not self.native.post_sampling_probs:
            return chat_logprobs(self.tokenizer, items)
        return [
            {
                **self._prob_item(item.token_id, item.logprob),
                "top_probs": [self._prob_item(t, lp) for t, lp in item.top],
            }
            for item in items
        ]

    def _prob_item(self, token_id: int, logprob: float) -> dict[str, Any]:
        tokenizer = self.tokenizer
        return {
            "id": token_id,
            "token": tokenizer.piece(token_id),
            "bytes": list(tokenizer.piece_bytes(token_id)),
            "prob": math.exp(logprob),
        }

    def _filled_context(self, final: GenerationEvent, request: GenerationRequest) -> bool:
        """llama-server's `truncated`: generation stopped because the slot's context is full
        (not at the request's own token limit)."""
        engine = self.state.engine
        n_ctx = engine.context_per_slot if engine is not None else 0
        if final.finish_reason != "length" or n_ctx <= 0:
            return False
        if request.max_tokens is not None and final.completion_tokens >= request.max_tokens:
            return False
        return final.prompt_tokens + final.completion_tokens >= n_ctx


class VerboseReport:
    """llama-server's `__verbose` debug object on an OpenAI-compatible answer: the native
    result object of the same generation (its `prompt` is the prompt as the model read it).

    Sent when the request says `verbose: true`, or by default under the server's
    `--verbose`, as llama-server does; on a stream, with the last chunk of the first choice.
    """

    def __init__(
        self, state: ServerState, request: GenerationRequest, model: str, *, stream: bool
    ) -> None:
        limit = -1 if request.max_tokens is None else request.max_tokens
        body = NativeCompletionRequest.model_validate({"stream": stream, "n_predict": limit})
        self._native = NativeEncoder(state, body, [request], model, single=True)
        self._text: list[str] = []

    def feed(self, event: GenerationEvent) -> None:
        """Note one streamed event of the first choice (its text)."""
        if event.text:
            self._text.append(event.text)

    def collected(self, events: list[GenerationEvent]) -> dict[str, Any]:
        """The object for a collected answer (the first choice's events)."""
        return self._native._result(0, events, events[-1])

    def streamed(self, final: GenerationEvent) -> dict[str, Any]:
        """The object for a stream, once its first choice has ended with `final`."""
        return self._native._result(0, [], final, content="".join(self._text))
