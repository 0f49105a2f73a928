"""Text completions: one prompt becomes one engine job; its events become the answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.engine.text.request import GenerationEvent, TokenLogprob
from mlxcel.server.errors import bad_request
from mlxcel.server.openai_common import (
    chat_logprobs,
    check_final,
    client_finish_reason,
    collect_events,
    envelope,
    new_id,
    now,
    record_request,
    reported_model,
    speculative_timings,
    usage_payload,
)
from mlxcel.server.openai_completions.protocol import CompletionRequest
from mlxcel.server.sampling_fields import PRIORITY_HEADER, parse_priority, to_generation_request
from mlxcel.server.sse import (
    SSE_DONE,
    SSE_PING,
    event_stream,
    sse_data,
    sse_template,
    with_keepalive,
)
from mlxcel.server.structured import compile_response_format

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.bridge import EngineStream
    from mlxcel.server.state import ServerState


def prompt_tokens(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """Token ids of `prompt`: a string, a list of one string, or token ids (flat or nested)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("prompt: only one prompt per request is supported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt: the prompt is empty")
        return tokenizer.encode(prompt, add_special=True)
    if not prompt:
        raise bad_request("prompt: the prompt is empty")
    return [int(t) for t in prompt]


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


class CompletionServing:
    """Runs text completion requests against the server's engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        """Answer one request: JSON, or an SSE stream once admission succeeded."""
        state = self.state
        assert state.client is not None and state.tokenizer is not None
        body.check_n()
        if body.best_of is not None and body.best_of != 1:
            raise bad_request(f"best_of: only best_of=1 is supported, not {body.best_of}")
        if body.suffix:
            raise bad_request("suffix is not supported; use POST /infill for fill-in-the-middle")
        grammar = await compile_response_format(state, body.with_json_schema(body.response_format))
        priority = parse_priority(raw.headers.get(PRIORITY_HEADER))
        tokenizer = state.tokenizer
        tokens = await run_in_threadpool(prompt_tokens, tokenizer, body.prompt)
        request = to_generation_request(
            body,
            settings=state.settings,
            tokenizer=tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=tokens,
            max_tokens=body.max_tokens,
            priority=priority,
            logprobs=body.logprobs,
        )
        request.grammar = grammar
        started = time.perf_counter()
        stream = state.client.open(request)  # 400/503 here, before any SSE header
        meta = {
            "id": new_id("cmpl-"),
            "created": now(),
            "model": reported_model(state, body.model),
        }
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(tokens)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return event_stream(
                self._stream(stream, meta, include_usage, echo), on_close=stream.close
            )
        return await self._complete(stream, meta, raw, started, echo)

    async def _complete(
        self,
        stream: EngineStream,
        meta: dict[str, Any],
        raw: Request,
        started: float,
        echo: str,
    ) -> Response:
        events = await collect_events(stream, raw)
        if events is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        final = events[-1]
        check_final(final)
        record_request(self.state, final, time.perf_counter() - started)
        assert self.state.tokenizer is not None
        logprobs = None
        if stream.request.logprobs is not None:
            items = [lp for e in events for lp in e.logprobs]
            logprobs = completion_logprobs(self.state.tokenizer, items, len(echo))
        return JSONResponse(
            {
                **envelope(meta, "text_completion"),
                "choices": [
                    {
                        "index": 0,
                        "text": echo + "".join(e.text for e in events),
                        "finish_reason": client_finish_reason(final),
                        "logprobs": logprobs,
                    }
                ],
                "usage": usage_payload(final.prompt_tokens, final.completion_tokens),
                **speculative_timings(final),
            }
        )

    def _chunk(
        self,
        meta: dict[str, Any],
        text: str,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        return sse_data(
            {
                **envelope(meta, "text_completion"),
                **(extra or {}),
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "finish_reason": finish_reason,
                        "logprobs": logprobs,
                    }
                ],
            }
        )

    async def _stream(
        self, stream: EngineStream, meta: dict[str, Any], include_usage: bool, echo: str
    ) -> AsyncIterator[str]:
        # Streaming /v1/completions requests are not recorded in the request counters.
        tokenizer = self.state.tokenizer
        assert tokenizer is not None
        want_logprobs = stream.request.logprobs is not None
        offset = len(echo)
        text_chunk = sse_template(lambda text: self._chunk(meta, text))
        try:
            if echo:
                yield self._chunk(meta, echo)
            final: GenerationEvent | None = None
            async for event in with_keepalive(stream, self.state.settings.sse_ping_interval):
                if event is None:
                    yield SSE_PING
                    continue
                logprobs = None
                if want_logprobs and event.logprobs:
                    logprobs = completion_logprobs(tokenizer, list(event.logprobs), offset)
                if event.text or logprobs:
                    chunk = (
                        text_chunk(event.text)
                        if logprobs is None
                        else self._chunk(meta, event.text, logprobs=logprobs)
                    )
                    yield chunk
                    offset += len(event.text)
                if event.finished:
                    final = event  # the stream ends right after its finishing event
            if final is None:
                return
            yield self._chunk(
                meta, "", client_finish_reason(final), extra=speculative_timings(final)
            )
            if include_usage:
                usage = usage_payload(final.prompt_tokens, final.completion_tokens)
                yield sse_data({**envelope(meta, "text_completion"), "choices": [], "usage": usage})
            yield SSE_DONE
        finally:
            stream.close()
