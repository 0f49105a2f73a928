"""`response_format` → a compiled grammar for the engine (JSON-schema constrained decoding)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxcel.engine.errors import EngineError, InvalidRequestError
from mlxcel.server.errors import APIError, bad_request
from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)


async def compile_response_format(
    state: ServerState, response_format: dict[str, Any] | None, gbnf: str | None = None
) -> Any:
    """The compiled grammar `response_format` (or llama-server's GBNF `grammar` field,
    `gbnf`) asks for, or None for plain text.

    `json_schema` gives its schema, `json_object` any JSON object (or llama-server's
    `schema` beside it). Both a GBNF grammar and a structured `response_format` is a 400,
    as are malformed wrappers, schemas or grammars over the limits or that the grammar
    engine rejects, and tokenizers it cannot drive (`UnsupportedTokenizer`).
    """
    from mlxcel.engine.grammar import get_grammar_backend, schema_from_response_format
    from mlxcel.engine.grammar.gbnf import compile_gbnf

    try:
        schema = schema_from_response_format(response_format)
    except (InvalidRequestError, ValueError) as exc:
        raise bad_request(str(exc)) from None
    if gbnf and schema is not None:
        raise bad_request("grammar: cannot be combined with a json_schema or json_object format")
    if schema is None and not gbnf:
        return None
    tokenizer = state.tokenizer
    assert tokenizer is not None
    try:
        backend = await run_in_threadpool(
            get_grammar_backend, state.settings.grammar_backend, tokenizer
        )
        if schema is None:
            assert gbnf is not None
            return await run_in_threadpool(compile_gbnf, backend, gbnf)
        return await run_in_threadpool(backend.compile_json_schema, schema)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), code=getattr(exc, "code", None)) from None
    except EngineError as exc:  # the configured grammar engine is not installed
        raise APIError(500, str(exc), "server_error") from None


async def compile_tool_choice(
    state: ServerState,
    format_name: str | None,
    tools: list[dict[str, Any]] | None,
    *,
    reasoning_close: str | None = None,
    max_calls: int = 8,
) -> Any:
    """The grammar enforcing a forced `tool_choice`, or None (instruction only).

    Formats without a JSON wire form, tokenizers or backends that cannot express it, and
    tool schemas the engine rejects all give None: forcing is then left to the directive.
    """
    from mlxcel.engine.grammar import get_grammar_backend
    from mlxcel.engine.grammar.tool_calls import WIRES, special_token_lookup, tool_call_grammar

    tokenizer = state.tokenizer
    if tokenizer is None or not tools or (format_name or "") not in WIRES:
        return None

    def build() -> Any:
        try:
            backend = get_grammar_backend(state.settings.grammar_backend, tokenizer)
        except (InvalidRequestError, EngineError) as exc:
            log.warning("forced tool_choice: no call grammar (%s); instruction only", exc)
            return None
        return tool_call_grammar(
            backend,
            format_name,
            tools,
            special_id=special_token_lookup(tokenizer, backend),
            reasoning_close=reasoning_close,
            max_calls=max_calls,
        )

    return await run_in_threadpool(build)
