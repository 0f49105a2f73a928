"""llama-server's native routes: completion, infill, tokenize, detokenize, apply-template.

Request bodies become engine jobs through the shared sampling fields; answers follow the
shapes llama-server sends (see `shared/spec/llama-server-samples.json`). No MLX here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.server.errors import APIError, bad_request, server_busy
from mlxcel.server.llama_native.protocol import (
    InfillRequest,
    NativeCompletionRequest,
    PromptPart,
    generation_settings,
    project_fields,
    split_prompts,
)
from mlxcel.server.openai_common import (
    chat_logprobs,
    check_final,
    collect_events,
    reported_model,
    scrub_paths,
)
from mlxcel.server.sampling_fields import PRIORITY_HEADER, parse_priority, to_generation_request
from mlxcel.server.sse import SSE_PING, event_stream, sse_data, with_keepalive

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.bridge import EngineStream
    from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
    from mlxcel.server.state import ServerState

# Fill-in-the-middle control tokens, by role, in the spellings model families use.
FIM_TOKENS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<｜fim▁begin｜>", "[PREFIX]"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<｜fim▁hole｜>", "[SUFFIX]"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<｜fim▁end｜>", "[MIDDLE]"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}


def fim_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the FIM roles the vocabulary has (`prefix`, `suffix`, `middle`, `file_sep`)."""
    cached = getattr(tokenizer, "_mlxcel_fim_ids", None)
    if cached is not None:
        return dict(cached)
    vocab = tokenizer.hf.get_vocab()
    found: dict[str, int] = {}
    for role, spellings in FIM_TOKENS.items():
        for spelling in spellings:
            if spelling in vocab:
                found[role] = int(vocab[spelling])
                break
    tokenizer._mlxcel_fim_ids = found  # type: ignore[attr-defined]
    return dict(found)


def piece_value(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """A token's piece: its text when it is valid UTF-8 on its own, else its bytes."""
    raw = tokenizer.piece_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def check_token_ids(tokenizer: Tokenizer, ids: list[int]) -> None:
    """500 `server_error` for the first id outside the vocabulary (llama-server's answer)."""
    vocab = tokenizer.vocab_size
    for token in ids:
        if token < 0 or token >= vocab:
            raise APIError(
                500,
                f"token id {token} is out of vocabulary range (vocab_size {vocab})",
                "server_error",
            )


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


class _SlotWatch:
    """Wraps an engine stream and notes the slot that serves it, at its first event."""

    def __init__(self, stream: EngineStream, state: ServerState) -> None:
        self.stream = stream
        self.request = stream.request
        self._state = state
        self.slot = -1
        self._looked = False

    def _locate(self) -> None:
        if self._looked or self._state.client is None:
            return
        self._looked = True  # the job holds a slot while it emits: one look is enough
        request_id = self.request.request_id
        for slot in self._state.client.engine.snapshot().slots:
            if slot.request_id == request_id:
                self.slot = slot.id
                return

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationEvent]:
        async for event in self.stream:
            slot = getattr(event, "slot", None)  # the engine may name it on every event
            if isinstance(slot, int) and slot >= 0:
                self.slot = slot
            elif self.slot < 0 and not event.finished:
                self._locate()  # best effort: a short job may be gone already
            yield event

    def close(self) -> None:
        self.stream.close()


class NativeServing:
    """Runs the native routes against the server's engine and tokenizer."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def tokenizer(self) -> Tokenizer:
        if self.state.tokenizer is None or self.state.client is None:
            raise server_busy("loading model")
        return self.state.tokenizer

    # ------------------------------------------------------------------ completion

    async def completion(self, body: NativeCompletionRequest, raw: Request) -> Response:
        """POST /completion: one result, or a list of them for several prompts."""
        tokenizer = self.tokenizer
        body.check_response_format()
        prompts = split_prompts(body.prompt)
        token_lists = [await run_in_threadpool(self._encode, tokenizer, p) for p in prompts]
        return await self._run(body, raw, token_lists, single=len(prompts) == 1)

    async def infill(self, body: InfillRequest, raw: Request) -> Response:
        """POST /infill: fill-in-the-middle; 501 when the vocabulary has no FIM tokens."""
        tokenizer = self.tokenizer
        fim = fim_token_ids(tokenizer)
        missing = [role for role in ("prefix", "suffix", "middle") if role not in fim]
        if missing:
            detail = "".join(f"{role} token is missing. " for role in missing)
            raise APIError(
                501, f"Infill is not supported by this model: {detail}", "not_supported_error"
            )
        body.check_response_format()
        if not isinstance(body.prompt, str):
            raise bad_request("prompt must be a string on /infill")
        tokens = await run_in_threadpool(self._infill_tokens, tokenizer, fim, body)
        return await self._run(body, raw, [tokens], single=True)

    def _encode(self, tokenizer: Tokenizer, parts: list[PromptPart]) -> list[int]:
        tokens: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                tokens.extend(tokenizer.encode(part, add_special=i == 0))
            else:
                tokens.append(part)
        return tokens

    def _infill_tokens(
        self, tokenizer: Tokenizer, fim: dict[str, int], body: InfillRequest
    ) -> list[int]:
        tokens: list[int] = []
        bos = tokenizer.bos_token_id
        if bos is not None and tokenizer.encode("a", add_special=True)[:1] == [bos]:
            tokens.append(bos)
        for i, chunk in enumerate(body.input_extra):
            # `text` is required, `filename` optional; both strings (llama-server's rule).
            text, filename = chunk.get("text"), chunk.get("filename", "")
            if not isinstance(text, str) or not isinstance(filename, str):
                raise bad_request(
                    f"input_extra[{i}]: needs a string 'text' (and 'filename', if given, "
                    "must be a string)"
                )
            if "file_sep" in fim:
                tokens.append(fim["file_sep"])
                tokens.extend(tokenizer.encode(f"{filename}\n{text}", add_special=False))
            else:
                tokens.extend(tokenizer.encode(text, add_special=False))
        tokens.append(fim["prefix"])
        tokens.extend(tokenizer.encode(body.input_prefix, add_special=False))
        tokens.append(fim["suffix"])
        tokens.extend(tokenizer.encode(body.input_suffix, add_special=False))
        tokens.append(fim["middle"])
        if body.prompt:
            tokens.extend(tokenizer.encode(body.prompt, add_special=False))
        return tokens

    def _request(
        self, body: NativeCompletionRequest, tokens: list[int], raw: Request
    ) -> GenerationRequest:
        state = self.state
        return to_generation_request(
            body,
            settings=state.settings,
            tokenizer=self.tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=tokens,
            max_tokens=body.token_limit(),
            priority=parse_priority(raw.headers.get(PRIORITY_HEADER)),
            logprobs=_logprobs_wanted(body),
        )

    async def _run(
        self,
        body: NativeCompletionRequest,
        raw: Request,
        token_lists: list[list[int]],
        *,
        single: bool,
    ) -> Response:
        client = self.state.client
        assert client is not None
        body.resolve_logit_bias(self.tokenizer)
        requests = [self._request(body, tokens, raw) for tokens in token_lists]
        streams: list[_SlotWatch] = []
        try:
            for request in requests:  # 400/503 here, before any SSE header
                streams.append(_SlotWatch(client.open(request), self.state))
        except BaseException:
            for opened in streams:
                opened.close()
            raise
        model = reported_model(self.state, body.model)
        if body.stream:

            def close_all() -> None:
                for opened in streams:
                    opened.close()

            return event_stream(self._stream(body, streams, model), on_close=close_all)
        results: list[dict[str, Any]] = []
        try:
            for index, watch in enumerate(streams):  # all run at once; read them in order
                result = await self._collect(body, index, watch, raw, model)
                if result is None:
                    return Response(status_code=499)  # the client is gone; nobody reads this
                results.append(result)
        finally:
            for watch in streams:
                watch.close()
        return JSONResponse(results[0] if single else results)

    async def _collect(
        self, body: NativeCompletionRequest, index: int, watch: _SlotWatch, raw: Request, model: str
    ) -> dict[str, Any] | None:
        events = await collect_events(watch, raw)  # type: ignore[arg-type]
        if events is None:
            return None
        final = events[-1]
        check_final(final)
        return self._result(body, index, watch, events, final, model)

    def _result(
        self,
        body: NativeCompletionRequest,
        index: int,
        watch: _SlotWatch,
        events: list[GenerationEvent],
        final: GenerationEvent,
        model: str,
        *,
        content: str | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """The full llama-server result object (also the last event of a stream)."""
        tokenizer = self.tokenizer
        request = watch.request
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
            "id_slot": watch.slot,
            "stop": True,
            "model": model,
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
            out["completion_probabilities"] = chat_logprobs(
                tokenizer, [lp for e in events for lp in e.logprobs]
            )
        return project_fields(out, body.response_fields) if body.response_fields else out

    def _filled_context(self, final: GenerationEvent, request: GenerationRequest) -> bool:
        """llama-server's `truncated`: generation stopped because the slot's context is full
        (not at the request's own token limit)."""
        client = self.state.client
        n_ctx = int(getattr(client.engine, "context_per_slot", 0)) if client is not None else 0
        if final.finish_reason != "length" or n_ctx <= 0:
            return False
        if request.max_tokens is not None and final.completion_tokens >= request.max_tokens:
            return False
        return final.prompt_tokens + final.completion_tokens >= n_ctx

    async def _stream(
        self, body: NativeCompletionRequest, streams: list[_SlotWatch], model: str
    ) -> AsyncIterator[str]:
        tokenizer = self.tokenizer
        predicted = [0] * len(streams)
        generated: list[list[int]] = [[] for _ in streams]
        try:
            merged = _merge(streams)
            async for item in with_keepalive(merged, self.state.settings.sse_ping_interval):
                if item is None:
                    yield SSE_PING
                    continue
                index, event = item
                watch = streams[index]
                if event.finished:
                    if event.finish_reason in ("error", "cancelled"):
                        detail = (
                            scrub_paths(event.error or "internal error")
                            if event.finish_reason == "error"
                            else "the server is shutting down"
                        )
                        yield sse_data({"error": _error_object(detail)})
                        return
                    if event.text:
                        yield sse_data(self._chunk(index, watch, event, predicted[index]))
                    yield sse_data(self._result(body, index, watch, [], event, model, content=""))
                    continue
                predicted[index] += len(event.token_ids)
                generated[index].extend(event.token_ids)
                chunk = self._chunk(index, watch, event, predicted[index])
                if body.n_probs > 0:
                    chunk["completion_probabilities"] = chat_logprobs(
                        tokenizer, list(event.logprobs)
                    )
                yield sse_data(chunk)
        finally:
            for watch in streams:
                watch.close()

    @staticmethod
    def _chunk(
        index: int, watch: _SlotWatch, event: GenerationEvent, predicted: int
    ) -> dict[str, Any]:
        return {
            "index": index,
            "content": event.text,
            "tokens": list(event.token_ids),
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": predicted,
            "tokens_evaluated": len(watch.request.prompt_tokens),
        }

    # ----------------------------------------------------------- tokenizer routes

    async def tokenize(self, content: str, add_special: bool, with_pieces: bool) -> dict[str, Any]:
        """POST /tokenize: ids, or `{id, piece}` objects with `with_pieces`."""
        tokenizer = self.tokenizer
        ids = await run_in_threadpool(tokenizer.encode, content, add_special=add_special)
        if not with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": piece_value(tokenizer, t)} for t in ids]}

    async def detokenize(self, ids: list[int]) -> dict[str, Any]:
        """POST /detokenize: every id is range-checked before anything is decoded."""
        tokenizer = self.tokenizer
        check_token_ids(tokenizer, ids)
        text = await run_in_threadpool(tokenizer.decode, ids)
        return {"content": text}

    async def apply_template(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """POST /apply-template: the chat prompt the model would see, as text (the same
        rendering as the chat route: tools, assistant prefill, generation prompt)."""
        from mlxcel.server.openai_chat.serving import ChatServing

        self.tokenizer  # noqa: B018 -- 503 while the model loads
        return {"prompt": await ChatServing(self.state).prompt_text(body)}


def _logprobs_wanted(body: NativeCompletionRequest) -> int | None:
    """Alternatives per token to ask the engine for.

    With `n_probs`, that many. Streams, `return_tokens` and stop strings (to tell a stop
    string from an end-of-generation token) need every token id, and the engine reports a
    token whose text is still held back (a partial UTF-8 sequence) only when logprobs are
    on: ask for the sampled token's alone then.
    """
    if body.n_probs > 0:
        return body.n_probs
    wanted = body.stream or body.return_tokens or body.stop_strings()
    return 0 if wanted else None


def _error_object(message: str) -> dict[str, Any]:
    return {"message": message, "type": "server_error", "code": None}


async def _merge(
    streams: list[_SlotWatch],
) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Events of several streams as `(index, event)`, in arrival order."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()

    async def pump(index: int, watch: _SlotWatch) -> None:
        async for event in watch:
            await queue.put((index, event))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, event = await queue.get()
            yield index, event
            if event.finished:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
