"""llama-server's native routes: completion, infill, tokenize, detokenize, apply-template.

Request bodies become engine jobs through the shared sampling fields; answers follow the
shapes llama-server sends (see `shared/spec/llama-server-samples.json`). No MLX here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.engine.text.request import GenerationRequest
from mlxcel.server.chat.core import ChatCore
from mlxcel.server.errors import APIError, bad_request, model_loading
from mlxcel.server.generation import Job
from mlxcel.server.llama_native.encoder import NativeEncoder
from mlxcel.server.llama_native.protocol import (
    InfillRequest,
    NativeCompletionRequest,
    PromptPart,
    TokenizeRequest,
    split_prompts,
)
from mlxcel.server.openai_common import (
    reported_model,
)
from mlxcel.server.sampling_fields import PRIORITY_HEADER, parse_priority, to_generation_request
from mlxcel.server.structured import compile_response_format

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.chat.messages_body import ChatMessagesBody
    from mlxcel.server.state import ServerState


def piece_value(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """A token's piece: its text when it is valid UTF-8 on its own, else its bytes."""
    raw = tokenizer.piece_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def check_token_ids(tokenizer: Tokenizer, ids: list[int]) -> None:
    """400 `invalid_request_error` naming the first id outside the vocabulary and the
    vocabulary's size (llama-server answers 500: the request is at fault, not the server)."""
    vocab = tokenizer.vocab_size
    for token in ids:
        if not tokenizer.is_valid_id(token):
            raise bad_request(f"token id {token} is out of vocabulary range (vocab_size {vocab})")


class NativeServing:
    """Runs the native routes against the server's engine and tokenizer."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def tokenizer(self) -> Tokenizer:
        if self.state.tokenizer is None or self.state.client is None:
            raise model_loading()
        return self.state.tokenizer

    # ------------------------------------------------------------------ completion

    async def completion(self, body: NativeCompletionRequest, raw: Request) -> Response:
        """POST /completion: one result, or a list of them for several prompts."""
        tokenizer = self.tokenizer
        grammar = await self._grammar(body)
        prompts = split_prompts(body.prompt)
        token_lists = [await run_in_threadpool(self._encode, tokenizer, p) for p in prompts]
        return await self._run(body, raw, token_lists, single=len(prompts) == 1, grammar=grammar)

    async def infill(self, body: InfillRequest, raw: Request) -> Response:
        """POST /infill: fill-in-the-middle; 501 when the vocabulary has no FIM tokens."""
        tokenizer = self.tokenizer
        fim = self.state.fim.ids(tokenizer)
        missing = [role for role in ("prefix", "suffix", "middle") if role not in fim]
        if missing:
            detail = "".join(f"{role} token is missing. " for role in missing)
            raise APIError(
                501, f"Infill is not supported by this model: {detail}", "not_supported_error"
            )
        grammar = await self._grammar(body)
        if not isinstance(body.prompt, str):
            raise bad_request("prompt must be a string on /infill")
        tokens = await run_in_threadpool(self._infill_tokens, tokenizer, fim, body)
        return await self._run(body, raw, [tokens], single=True, grammar=grammar)

    async def _grammar(self, body: NativeCompletionRequest) -> Any:
        """The compiled grammar of llama-server's `json_schema` field or a `json_object` /
        `json_schema` response_format (None for plain text); 400 as on the OpenAI routes."""
        response_format = body.with_json_schema(body.response_format)
        return await compile_response_format(self.state, response_format, body.gbnf_grammar())

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
        body.check_n()  # one sequence per request here
        request = to_generation_request(
            body,
            settings=state.settings,
            tokenizer=self.tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=tokens,
            max_tokens=body.token_limit(),
            priority=parse_priority(raw.headers.get(PRIORITY_HEADER)),
            logprobs=_logprobs_wanted(body),
        )
        request.post_sampling_probs = bool(body.post_sampling_probs) and body.n_probs > 0
        return request

    async def _run(
        self,
        body: NativeCompletionRequest,
        raw: Request,
        token_lists: list[list[int]],
        *,
        single: bool,
        grammar: Any = None,
    ) -> Response:
        body.resolve_logit_bias(self.tokenizer)
        requests = [self._request(body, tokens, raw) for tokens in token_lists]
        for request in requests:
            body.stream_reports(request, stream=body.stream)
            request.grammar = grammar
        job = Job.admit(self.state, requests)  # 400/503 here, before any SSE header
        model = reported_model(self.state, body.model)
        encoder = NativeEncoder(self.state, body, requests, model, single=single)
        return await job.respond(raw, encoder, stream=body.stream)

    # ----------------------------------------------------------- tokenizer routes

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """POST /tokenize: ids, or `{id, piece}` objects with `with_pieces`."""
        tokenizer = self.tokenizer
        ids = await run_in_threadpool(
            tokenizer.encode,
            body.content,
            add_special=body.add_special,
            parse_special=body.parse_special,
        )
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": piece_value(tokenizer, t)} for t in ids]}

    async def detokenize(self, ids: list[int]) -> dict[str, Any]:
        """POST /detokenize: every id is range-checked before anything is decoded."""
        tokenizer = self.tokenizer
        check_token_ids(tokenizer, ids)
        text = await run_in_threadpool(tokenizer.decode, ids)
        return {"content": text}

    async def apply_template(self, body: ChatMessagesBody) -> dict[str, Any]:
        """POST /apply-template: the chat prompt the model would see, as text (the same
        rendering as the chat route: tools, assistant prefill, generation prompt)."""
        self.tokenizer  # noqa: B018 -- 503 while the model loads
        return {"prompt": await ChatCore(self.state).prompt_text(body.chat_request())}


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
