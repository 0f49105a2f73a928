"""Text completions: one prompt becomes one engine job per choice (`n`); their events
become the answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.errors import bad_request
from mlxcel.server.generation import Job
from mlxcel.server.llama_native.encoder import VerboseReport
from mlxcel.server.openai_common import new_id, now, reported_model
from mlxcel.server.openai_completions.encoder import CompletionEncoder
from mlxcel.server.openai_completions.protocol import CompletionRequest
from mlxcel.server.sampling_fields import (
    MAX_CHOICES,
    PRIORITY_HEADER,
    parse_priority,
    per_choice,
    to_generation_request,
)
from mlxcel.server.structured import compile_response_format

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
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


class CompletionServing:
    """Runs text completion requests against the server's engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        """Answer one request: JSON, or an SSE stream once admission succeeded."""
        state = self.state
        assert state.client is not None and state.tokenizer is not None
        if body.best_of is not None and body.best_of not in (1, body.n or 1):
            raise bad_request(
                f"best_of: only best_of=1 or best_of=n is supported, not {body.best_of}"
            )
        if body.suffix:
            raise bad_request("suffix is not supported; use POST /infill for fill-in-the-middle")
        grammar = await compile_response_format(
            state, body.with_json_schema(body.response_format), body.gbnf_grammar()
        )
        priority = parse_priority(raw.headers.get(PRIORITY_HEADER))
        choices = body.check_n(MAX_CHOICES)
        tokenizer = state.tokenizer
        tokens = await run_in_threadpool(prompt_tokens, tokenizer, body.prompt)
        request = to_generation_request(
            body,
            settings=state.settings,
            tokenizer=tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=tokens,
            max_tokens=body.token_limit(),
            priority=priority,
            logprobs=body.logprobs,
        )
        request.grammar = grammar
        body.stream_reports(request, stream=body.stream)
        verbose = body.wants_verbose(state.settings.verbose)
        job = Job.admit(state, per_choice(request, choices))  # 400/503 before any SSE header
        meta = {
            "id": new_id("cmpl-"),
            "created": now(),
            "model": reported_model(state, body.model),
        }
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(tokens)
        encoder = CompletionEncoder(
            tokenizer,
            meta,
            want_logprobs=request.logprobs is not None,
            echo=echo,
            include_usage=bool(
                body.stream and body.stream_options and body.stream_options.include_usage
            ),
            choices=choices,
            timings_per_token=request.timings_per_token,
            verbose=VerboseReport(state, request, str(meta["model"]), stream=body.stream)
            if verbose
            else None,
        )
        return await job.respond(raw, encoder, stream=body.stream)
