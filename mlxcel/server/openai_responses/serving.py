"""OpenAI Responses: a Responses body becomes a chat request; its output becomes items.

A request (plus the stored history of `previous_response_id` or `conversation`) is
translated into the chat core's `ChatRequest` and admitted by `ChatCore.start`, so tools,
`tool_choice`, structured output, reasoning and every 400/503 behave exactly as on
/v1/chat/completions; errors name the Responses fields (`input[0].content`, `top_k`...).
The chat output deltas go through `OutputAssembler` into output items: a JSON response,
or typed SSE events.

Reusable pieces (the compaction route and `context_management` build on them):
`ResponsesServing.chat_request`, `.count_tokens` and `.generate_text`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.server.chat.core import ChatCore
from mlxcel.server.chat.prompt import RenderedPrompt
from mlxcel.server.chat.request import ChatOptions, ChatRequest, ChatTurn
from mlxcel.server.errors import APIError, model_loading
from mlxcel.server.openai_common import (
    reported_model,
)
from mlxcel.server.openai_responses.compaction import (
    CompactionAborted,
    CompactionResult,
    auto_compact,
    compact,
    compact_response,
    expand_compactions,
    output_budget,
    parse_compact_request,
    parse_context_management,
)
from mlxcel.server.openai_responses.encoder import ResponseEncoder
from mlxcel.server.openai_responses.items import (
    input_items,
    invalid_request,
    items_to_messages,
    items_to_turns,
    listed,
    with_ids,
)
from mlxcel.server.openai_responses.pagination import PageQuery, list_page
from mlxcel.server.openai_responses.protocol import RESPONSES_FIELDS, ResponsesRequest
from mlxcel.server.openai_responses.store import ResponseStores, StoredResponse

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

BUILTIN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "custom",
        "apply_patch",
        "function_shell",
        "shell",
        "local_shell",
        "namespace",
        "tool_search",
        "programmatic_tool_calling",
    }
)
"""Hosted tool types: refused with 400 (only `function` tools run here)."""

CANCEL_WAIT_SECONDS = 10.0
"""How long POST /cancel waits for a generating response to stop."""

STORE_DISABLED = "the response store is disabled (--responses-store-max-entries 0)"


def not_found(response_id: str) -> APIError:
    """404 for a response id that is not (or no longer) stored."""
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        "not_found_error",
        extra={"param": "response_id"},
    )


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's nested ones; 400 for hosted tool types."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            if not isinstance(kind, str):
                raise invalid_request(f"{where}.type must be a string", f"{where}.type")
            if kind in BUILTIN_TOOLS:
                raise invalid_request(
                    f"{where}: built-in tool type {kind!r} is not supported; "
                    "only function tools are",
                    f"{where}.type",
                )
            raise invalid_request(f"{where}: unsupported tool type {kind!r}", f"{where}.type")
        if isinstance(tool.get("function"), dict):  # already the chat shape
            out.append({"type": "function", "function": dict(tool["function"])})
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"{where}.name must be a non-empty string", f"{where}.name")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _function_name(choice: dict[str, Any]) -> str:
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_request("tool_choice must name a function", "tool_choice")
    return name


def chat_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> tuple[str | dict[str, Any] | None, list[dict[str, Any]] | None]:
    """(chat `tool_choice`, chat tools) for a Responses `tool_choice`.

    `auto`/`none`/`required` map as they are, `{"type": "function", "name"}` to the chat
    named form; `{"type": "any"}` reads as `required`, `{"type": "tool", "name"}` as a named
    function, and `{"type": "allowed_tools", "mode", "tools"}` narrows the tools.
    """
    if choice is None or choice in ("auto", "none", "required"):
        return choice, tools
    if not isinstance(choice, dict):
        raise invalid_request(
            "tool_choice must be 'none', 'auto', 'required' or a function object", "tool_choice"
        )
    kind = choice.get("type")
    if kind in ("function", "tool"):
        return {"type": "function", "function": {"name": _function_name(choice)}}, tools
    if kind == "any":
        return "required", tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        allowed = choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise invalid_request(
                "tool_choice allowed_tools needs a mode (auto or required) and a tools list",
                "tool_choice",
            )
        names = {t.get("name") for t in allowed if isinstance(t, dict)}
        narrowed = [t for t in tools or [] if t["function"].get("name") in names]
        return mode, narrowed
    raise invalid_request(f"tool_choice type {kind!r} is not supported", "tool_choice.type")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind == "json_object":
        return {"type": "json_object"}
    raise invalid_request(f"text.format type {kind!r} is not supported", "text.format.type")


def conversation_id(value: str | dict[str, Any] | None) -> str | None:
    """The conversation id of `conversation` (a string, or `{"id": ...}`)."""
    if value is None:
        return None
    ident = value.get("id") if isinstance(value, dict) else value
    if not isinstance(ident, str) or not ident:
        raise invalid_request("conversation must be a non-empty id string", "conversation")
    return ident


def check_request(body: ResponsesRequest) -> None:
    """The 400s of fields this server does not support."""
    if body.background:
        raise invalid_request("background responses are not supported", "background")
    if body.truncation not in (None, "disabled"):
        raise invalid_request("truncation must be 'disabled'", "truncation")
    if body.previous_response_id is not None and body.conversation is not None:
        raise invalid_request(
            "previous_response_id and conversation cannot be used together",
            "previous_response_id",
        )


SUMMARY_SAMPLING = ("temperature", "top_p")
"""Responses fields a compact body may carry that still apply to the summary generation."""


def summary_extra(fields: dict[str, Any]) -> dict[str, Any]:
    """Chat request fields for a compact body's summary generation: its sampling extras
    (`top_k`, `seed`, `chat_template_kwargs`...) and `temperature` / `top_p`, never the
    Responses fields a client sends along (`tools`, `text`, `reasoning`, `store`...), and no
    thinking (`thinking_budget_tokens: 0`)."""
    extra = {
        key: value
        for key, value in fields.items()
        if key not in RESPONSES_FIELDS or (key in SUMMARY_SAMPLING and value is not None)
    }
    return {**extra, "thinking_budget_tokens": 0}


def chat_options(fields: dict[str, Any], prefix: str = "") -> ChatOptions:
    """The chat options (sampling knobs, template switches...) among a body's `fields`;
    a bad value is a 400 naming the field as the client sent it."""
    try:
        return ChatOptions.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid value')}"
        raise invalid_request(prefix + message, where or None) from None


def chat_turns(
    body: ResponsesRequest, items: list[dict[str, Any]], inputs: dict[int, str]
) -> list[ChatTurn]:
    """The chat turns of `items` (normalized, history included) after `body`'s
    instructions; `inputs` names this request's own items by identity (`input[i]`)."""
    turns = items_to_turns(expand_compactions(items), lambda item: inputs.get(id(item), "input"))
    if body.instructions:
        turns.insert(0, ChatTurn({"role": "system", "content": body.instructions}, "instructions"))
    if not turns:
        raise invalid_request("input: at least one input item is needed", "input")
    return turns


@dataclass(frozen=True)
class Prepared:
    """A checked request: the chat request it runs as and the items it adds."""

    body: ResponsesRequest
    chat: ChatRequest
    history: list[dict[str, Any]]  # items of the previous response or the conversation
    items: list[dict[str, Any]]  # this request's input, normalized
    conversation: str | None
    inputs: dict[int, str] = field(default_factory=dict)  # id(item) -> `input[i]`


@dataclass
class GeneratedText:
    """One non-streamed generation over chat messages (`generate_text`)."""

    text: str
    reasoning: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class ResponsesServing:
    """Runs /v1/responses requests; `stores` hold stored responses and conversations."""

    def __init__(self, state: ServerState, stores: ResponseStores) -> None:
        self.state = state
        self.stores = stores
        self.core = ChatCore(state)

    # ------------------------------------------------------------ translation

    def chat_request(
        self,
        body: ResponsesRequest,
        items: list[dict[str, Any]],
        inputs: dict[int, str] | None = None,
    ) -> ChatRequest:
        """The chat request rendering `items` (normalized, history included) with `body`'s
        instructions, tools, tool_choice, text format and sampling fields; 400 on errors,
        naming the Responses fields (`inputs`: this request's items, see `chat_turns`)."""
        turns = chat_turns(body, items, inputs or {})
        tools = chat_tools(body.tools)
        tool_choice, tools = chat_tool_choice(body.tool_choice, tools)
        fields = body.passthrough()
        fields.update(
            (k, v)
            for k, v in (("temperature", body.temperature), ("top_p", body.top_p))
            if v is not None
        )
        options = chat_options(fields)
        response_format = chat_response_format(body.text)
        if response_format is None and isinstance(fields.get("response_format"), dict):
            response_format = fields["response_format"]
        return ChatRequest.build(
            turns,
            options,
            max_tokens=body.max_output_tokens,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=response_format,
        )

    def _history(self, body: ResponsesRequest, conversation: str | None) -> list[dict[str, Any]]:
        previous = body.previous_response_id
        if previous is not None:
            if not self.stores.responses.enabled:
                raise invalid_request(
                    f"previous_response_id needs stored responses: {STORE_DISABLED}",
                    "previous_response_id",
                )
            stored = self.stores.responses.get(previous)
            if stored is None:
                raise invalid_request(
                    f"Previous response with id '{previous}' not found.",
                    "previous_response_id",
                    code="previous_response_not_found",
                )
            if stored.response.get("status") == "in_progress":
                raise invalid_request(
                    f"Previous response with id '{previous}' is still in progress.",
                    "previous_response_id",
                )
            return list(stored.history)
        if conversation is not None:
            if not self.stores.conversations.enabled:
                raise invalid_request(
                    "conversation needs stored conversations, which are disabled "
                    "(--conversation-store-max-entries 0)",
                    "conversation",
                )
            known = self.stores.conversations.get(conversation)
            return list(known.items) if known is not None else []
        return []

    def prepare(self, body: ResponsesRequest) -> Prepared:
        """Check `body`, resolve its history and build its chat request; 400 on errors."""
        check_request(body)
        conversation = conversation_id(body.conversation)
        history = self._history(body, conversation)
        items = with_ids(input_items(body.input))
        inputs = {id(item): f"input[{i}]" for i, item in enumerate(items)}
        chat = self.chat_request(body, history + items, inputs)
        return Prepared(body, chat, history, items, conversation, inputs)

    # ------------------------------------------------------------ reusable steps

    async def count_tokens(self, body: ResponsesRequest, items: list[dict[str, Any]]) -> int:
        """Prompt tokens of `items` (normalized) rendered with `body`'s settings, exactly
        as a create request would render them."""
        return len((await self.core.render(self.chat_request(body, items))).tokens)

    async def generate_text(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int,
        raw: Request,
        *,
        extra: dict[str, Any] | None = None,
    ) -> GeneratedText | None:
        """One non-streamed generation over chat `messages`, at most `max_tokens` tokens.

        `extra` adds chat request fields (sampling, `chat_template_kwargs`...). The text is
        the answer's content, reasoning split off. None when the client went away; 400/503
        before the job runs, 500/503 when it fails.
        """
        options = chat_options(extra or {}, "invalid generation request: ")
        turns = [ChatTurn(message, "input") for message in messages]
        request = ChatRequest.build(turns, options, max_tokens=max_tokens)
        job = await self.core.start(request, raw)
        results = await job.job.collect(raw)  # counted there; 500/503 when it failed
        if results is None:
            return None
        events = results[0]
        final = events[-1]
        result = job.plan.parse("".join(e.text for e in events))
        return GeneratedText(
            text=result.content,
            reasoning=result.reasoning,
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            finish_reason=final.finish_reason or "stop",
        )

    # ------------------------------------------------------------ routes

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        """POST /v1/responses: JSON, or typed SSE events once admission succeeded."""
        threshold = parse_context_management(body.context_management)
        prepared = self.prepare(body)
        compaction, chat, prompt = None, prepared.chat, None
        if threshold is not None:
            compaction, chat, prompt = await self._manage_context(prepared, threshold, raw)
        job = await self.core.start(chat, raw, stream_reports=body.stream, prompt=prompt)
        encoder = ResponseEncoder(self, prepared, job, compaction)
        return await job.job.respond(raw, encoder, stream=body.stream)

    def context_window(self) -> int:
        """Tokens one request may hold (the per-slot context)."""
        engine = self.state.engine
        if engine is None:
            raise model_loading()
        return engine.context_per_slot

    async def compact(self, payload: Any, raw: Request) -> Response:
        """POST /v1/responses/compact: summarize older turns into one compaction item.

        Nothing is stored. 400 (`context_length_exceeded` where the spec says) before any
        change; 499 when the client went away during the summary.
        """
        if self.state.tokenizer is None:
            raise model_loading()
        request = parse_compact_request(payload)
        counting = ResponsesRequest.model_validate(
            {"model": request.model, "instructions": request.instructions, "input": ""}
        )

        async def count(items: list[dict[str, Any]]) -> int:
            return await self.count_tokens(counting, items)

        extra = summary_extra(request.extra)

        async def summarize(messages: list[dict[str, Any]], limit: int) -> Any:
            return await self.generate_text(messages, limit, raw, extra=extra)

        try:
            result = await compact(
                request.items,
                count_tokens=count,
                summarize=summarize,
                to_messages=items_to_messages,
                context_window=self.context_window(),
                keep_tokens=request.keep_tokens,
                max_output_tokens=request.max_output_tokens,
            )
        except CompactionAborted:
            return Response(status_code=499)
        model = reported_model(self.state, request.model)
        out = compact_response(result, model=model)
        out["output"] = [listed(item) for item in out["output"]]
        return JSONResponse(out)

    async def _manage_context(
        self, prepared: Prepared, threshold: int, raw: Request
    ) -> tuple[CompactionResult | None, ChatRequest, RenderedPrompt]:
        """`context_management`: compact the history first when the input reaches
        `threshold` or leaves no room to answer; bound the answer by the context left.

        Returns the compaction (None when none was needed), the chat request of the
        (compacted) history and its prompt, rendered once: counting the input renders it,
        and that rendering is the one admitted.
        """
        body = prepared.body
        window = self.context_window()
        items = prepared.history + prepared.items
        last = [(items, prepared.chat, await self.core.render(prepared.chat))]

        async def render(items: list[dict[str, Any]]) -> tuple[ChatRequest, RenderedPrompt]:
            if last[0][0] is items:
                return last[0][1], last[0][2]
            chat = self.chat_request(body, items, prepared.inputs)
            prompt = await self.core.render(chat)
            last[:] = [(items, chat, prompt)]
            return chat, prompt

        async def count(items: list[dict[str, Any]]) -> int:
            return len((await render(items))[1].tokens)

        async def summarize(messages: list[dict[str, Any]], limit: int) -> Any:
            extra = {**body.passthrough(), "thinking_budget_tokens": 0}
            extra.pop("stream", None)
            return await self.generate_text(messages, limit, raw, extra=extra)

        try:
            result = await auto_compact(
                items,
                threshold=threshold,
                count_tokens=count,
                summarize=summarize,
                to_messages=items_to_messages,
                context_window=window,
                input_tokens=len(last[0][2].tokens),
            )
        except CompactionAborted:
            raise APIError(499, "the client went away", "invalid_request_error") from None
        chat, prompt = await render(result.history if result is not None else items)
        budget = output_budget(window, len(prompt.tokens), body.max_output_tokens)
        if budget <= 0:
            raise invalid_request(
                "the input leaves no room for output in the context window",
                "input",
                code="context_length_exceeded",
            )
        return result, replace(chat, max_tokens=budget), prompt

    async def input_tokens(self, body: ResponsesRequest) -> dict[str, Any]:
        """POST /v1/responses/input_tokens: the prompt tokens `body` would use."""
        if self.state.tokenizer is None:
            raise model_loading()
        prepared = self.prepare(body)
        prompt = await self.core.render(prepared.chat)
        return {"object": "response.input_tokens", "input_tokens": len(prompt.tokens)}

    def _stored(self, response_id: str) -> StoredResponse:
        if not self.stores.responses.enabled:
            raise invalid_request(STORE_DISABLED, "response_id")
        stored = self.stores.responses.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}."""
        return self._stored(response_id).response

    def input_items(self, response_id: str, query: PageQuery) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: the request's own input items, one page."""
        return list_page(self._stored(response_id).input_items, query)

    def delete(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}."""
        self._stored(response_id)
        self.stores.responses.pop(response_id)
        running = self.stores.inflight.get(response_id)
        if running is not None:  # keep it from being stored when it finishes
            running.deleted = True
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """POST /v1/responses/{id}/cancel: stop it if it is generating; status `cancelled`."""
        self._stored(response_id)
        running = self.stores.inflight.get(response_id)
        if running is not None:
            running.cancelled = True
            running.stream.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(running.done.wait(), CANCEL_WAIT_SECONDS)
        stored = self._stored(response_id)
        stored.response["status"] = "cancelled"
        return stored.response
