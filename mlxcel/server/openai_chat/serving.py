"""Chat completions: a request body becomes one engine job per choice (`n`); their events
become the answer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.engine.chat.messages import strip_think_blocks
from mlxcel.engine.chat.tool_calls.base import ParseResult
from mlxcel.engine.prompting import PromptError, render_chat, without_added_bos
from mlxcel.engine.text.thinking_budget import ThinkingBudget
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
from mlxcel.server.errors import APIError, bad_request, scrub_paths, server_busy
from mlxcel.server.generation import Job
from mlxcel.server.json_body import decode_json_body
from mlxcel.server.llama_native.encoder import VerboseReport
from mlxcel.server.media import MediaError
from mlxcel.server.media.parts import collect_media, has_media, prepare_off_loop
from mlxcel.server.openai_chat.encoder import ChatEncoder
from mlxcel.server.openai_chat.output_plan import REASONING_FORMATS, OutputPlan, plan_output
from mlxcel.server.openai_chat.protocol import ChatCompletionRequest, ChatMessage
from mlxcel.server.openai_common import new_id, now, reported_model
from mlxcel.server.sampling_fields import (
    MAX_CHOICES,
    PRIORITY_HEADER,
    parse_priority,
    per_choice,
    to_generation_request,
)
from mlxcel.server.structured import compile_response_format, compile_tool_choice

if TYPE_CHECKING:
    from mlxcel.engine.text.request import GenerationEvent
    from mlxcel.server.bridge import EngineStream
    from mlxcel.server.state import ServerState


log = logging.getLogger(__name__)


@dataclass
class ChatJob:
    """An admitted chat request: its generation job and the parsers its output goes through."""

    job: Job
    plan: OutputPlan
    prompt_tokens: int
    forced: bool = False

    @property
    def stream(self) -> EngineStream:
        """The engine stream of the (single) sequence."""
        return self.job.streams[0]

    def parse(self, events: list[GenerationEvent]) -> ParseResult:
        """The whole collected output, split (a forced call that did not come is logged)."""
        result = self.plan.parse("".join(e.text for e in events))
        self.check_forced(result)
        return result

    def check_forced(self, result: ParseResult) -> None:
        """Log at warn when a forced tool_choice ended without a call."""
        if self.forced and not result.calls:
            log.warning(
                "request %s: tool_choice forced a call but the model made none",
                self.job.request.request_id,
            )


REQUIRED_TOOL_DIRECTIVE = "You must call at least one of the provided functions."
NAMED_TOOL_DIRECTIVE = "You must call the function `{name}`."


def _flatten_content(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"messages[{index}].content: a text part needs a string 'text'")
            texts.append(text)
        else:
            raise bad_request(
                f"messages[{index}].content: '{kind}' content parts are not supported by this "
                "model (text only)"
            )
    return "\n".join(texts)


def _template_message(
    index: int, message: ChatMessage, content: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The message as a chat template gets it; `content`: its parts with media placeholders."""
    out: dict[str, Any] = dict(message.model_extra or {})
    out["role"] = message.role
    out["content"] = content if content is not None else _flatten_content(index, message.content)
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            call = dict(call)
            function = call.get("function")
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function = dict(function)
                try:  # too deep or a lone surrogate: kept as text, as non-JSON is
                    parsed = decode_json_body(function["arguments"].encode(), "arguments")
                except APIError:
                    parsed = None
                if isinstance(parsed, dict):  # templates expect an object, as transformers does
                    function["arguments"] = parsed
                call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def _select_tools(
    body: ChatCompletionRequest,
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tools to render, directive to add) for `tools` + `tool_choice`."""
    tools = body.tools or None
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs at least one tool in 'tools'")
        return tools, REQUIRED_TOOL_DIRECTIVE
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad_request("tool_choice must name a function: {'type': 'function', ...}")
        chosen = [
            t
            for t in tools or []
            if isinstance(t.get("function"), dict) and t["function"].get("name") == name
        ]
        if not chosen:
            raise bad_request(f"tool_choice names '{name}', which is not declared in 'tools'")
        return chosen, NAMED_TOOL_DIRECTIVE.format(name=name)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or a function object")


def _add_directive(messages: list[dict[str, Any]], directive: str) -> None:
    """Put a tool directive into the first system message, else the last user message."""
    for message in messages:
        if message["role"] == "system":
            message["content"] = f"{message['content']}\n\n{directive}".lstrip()
            return
    for message in reversed(messages):
        if message["role"] == "user":
            message["content"] = f"{message['content']}\n\n{directive}".lstrip()
            return
    messages.insert(0, {"role": "system", "content": directive})


def assistant_prefill(
    body: ChatCompletionRequest, messages: list[dict[str, Any]]
) -> tuple[bool, str | None]:
    """(add_generation_prompt, prefill text) for rendering `messages`.

    As llama-server: a trailing assistant message (text, no tool calls) is a prefill the
    model continues: it is taken off `messages`, the rest is rendered with the generation
    prompt and its text is appended. `continue_final_message` (vLLM) asks for the same and
    400s without a final assistant message; `add_generation_prompt: false` renders the
    messages as they are. Two trailing assistant messages, or both switches set, are 400.
    """
    wants_prompt = body.add_generation_prompt
    if body.continue_final_message and wants_prompt:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true")
    last = messages[-1] if messages else None
    continues = (
        last is not None
        and last["role"] == "assistant"
        and not last.get("tool_calls")
        and (body.continue_final_message or (wants_prompt is not False and body.prefill_assistant))
    )
    if body.continue_final_message and not continues:
        raise bad_request("continue_final_message needs a final assistant message to continue")
    if not continues:
        return wants_prompt is not False, None
    if len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
    assert last is not None
    messages.pop()
    original = body.messages[-1].content
    if isinstance(original, list):
        # llama.cpp joins the text parts of the message it continues with a blank line.
        texts = [p.get("text") for p in original if p.get("type") in ("text", "input_text")]
        return True, "\n\n".join(t for t in texts if isinstance(t, str))
    return True, str(last["content"])


def _forced_tool_choice(tool_choice: Any) -> bool:
    """`required` or a named function: choices that would need their own grammar."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)
"""chat_template_kwargs keys that would override what the server renders (400)."""

THINKING_BUDGET_FIELDS = ("thinking_budget_tokens", "thinking_token_budget", "thinking_budget")
"""Per-request aliases of `--reasoning-budget`, first match wins."""


def request_reasoning_format(body: ChatCompletionRequest) -> str | None:
    """llama-server's per-request `reasoning_format` (None: the server's)."""
    value = (body.model_extra or {}).get("reasoning_format")
    if value is None:
        return None
    if value not in REASONING_FORMATS:
        raise bad_request(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
    return str(value)


def thinking_budget(state: ServerState, body: ChatCompletionRequest) -> int:
    """Reasoning tokens allowed (-1: unlimited): the request's alias, else the server's."""
    sources = [body.model_extra or {}, body.extra_body or {}]
    for source in sources:
        for name in THINKING_BUDGET_FIELDS:
            value = source.get(name)
            if value is None:
                continue
            if type(value) is not int or value < -1:
                raise bad_request(f"'{name}' must be an integer >= -1 (-1: no limit, 0: off)")
            return value
    return int(state.settings.reasoning_budget)


def template_kwargs(state: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    """Server `--chat-template-kwargs` merged with the request's (the request's keys win).

    The request's come from the first form present: `chat_template_kwargs`, then
    `extra_body.chat_template_kwargs`, then `extra_body.preserve_thinking`. Keys the server
    renders itself (`messages`, `tools`, special tokens...) are refused with 400. A thinking
    budget of 0 renders with `enable_thinking: false` unless that key is given; under
    `--reasoning auto` a template with an `enable_thinking` switch renders with `true`
    unless that key is given (llama-server's auto: thinking on where the template can).
    """
    nested = body.extra_body or {}
    requested: dict[str, Any] = {}
    if body.chat_template_kwargs is not None:
        requested = dict(body.chat_template_kwargs)
    elif isinstance(nested.get("chat_template_kwargs"), dict):
        requested = dict(nested["chat_template_kwargs"])
    elif isinstance(nested.get("preserve_thinking"), bool):
        requested = {"preserve_thinking": nested["preserve_thinking"]}
    elif isinstance((body.model_extra or {}).get("preserve_thinking"), bool):
        requested = {"preserve_thinking": (body.model_extra or {})["preserve_thinking"]}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(requested))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs cannot set {', '.join(reserved)}: the server renders it"
        )
    merged = {**dict(state.settings.chat_template_kwargs or {}), **requested}
    if thinking_budget(state, body) == 0:
        merged.setdefault("enable_thinking", False)
    if state.settings.reasoning == "auto" and template_has_thinking_switch(state):
        merged.setdefault("enable_thinking", True)
    return merged


def template_has_thinking_switch(state: ServerState) -> bool:
    """Whether the loaded chat template reads `enable_thinking` (llama-server's `--reasoning
    auto` then renders it with thinking on; a template without the switch is unchanged)."""
    template = state.tokenizer.chat_template if state.tokenizer is not None else None
    return isinstance(template, str) and "enable_thinking" in template


class ChatServing:
    """Runs chat completion requests against the server's engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def start(
        self,
        body: ChatCompletionRequest,
        raw: Request,
        *,
        max_choices: int = 1,
        stream_reports: bool = False,
    ) -> ChatJob:
        """Validate, render and admit `body`: the engine job (one sequence per choice, `n`
        up to `max_choices`) and how to read its output; `stream_reports`: the answer
        streams and its encoder sends llama-server's `timings_per_token` and
        `return_progress` chunks when the body asks for them.

        Every 400 and 503 is raised here, before a response (or SSE header) is sent. The
        Responses and Anthropic Messages routes translate their bodies into a chat request
        and share this path, so tools, tool_choice, structured output and reasoning behave
        the same on all three.
        """
        state = self.state
        assert state.client is not None and state.tokenizer is not None
        grammar = await compile_response_format(
            state, body.with_json_schema(body.response_format), body.gbnf_grammar()
        )
        if grammar is not None and _forced_tool_choice(body.tool_choice):
            raise bad_request(
                "a forced tool_choice cannot be combined with a json_schema or json_object "
                "response_format or a grammar"
            )
        priority = parse_priority(raw.headers.get(PRIORITY_HEADER))
        tools, prompt_text, tokens, media = await self._render_with_media(body)
        plan = plan_output(state, tools, prompt_text, request_reasoning_format(body))
        forced = _forced_tool_choice(body.tool_choice) and bool(tools)
        if forced and grammar is None and plan.tool_format is not None:
            close = plan.reasoning.close_tag if plan.start_in_reasoning and plan.reasoning else None
            single = isinstance(body.tool_choice, dict) or (
                (body.model_extra or {}).get("parallel_tool_calls") is False
            )
            grammar = await compile_tool_choice(
                state,
                plan.tool_format.name,
                tools,
                reasoning_close=close,
                max_calls=1 if single else 8,
            )
        request = to_generation_request(
            body,
            settings=state.settings,
            tokenizer=state.tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=tokens,
            max_tokens=body.token_limit(),
            priority=priority,
            logprobs=body.logprobs_count(),
            max_choices=max_choices,
        )
        request.grammar = grammar
        if state.media is not None:  # a vision engine: the prompt text and its decoded media
            request.media = VisionPrompt(prompt_text, media or VisionInputs())
            if state.client is not None:
                try:  # the processor off the event loop; submit reuses its result
                    await prepare_off_loop(state.client.engine, request.media)
                except MediaError as exc:
                    raise bad_request(str(exc)) from None
        budget = thinking_budget(state, body)
        if budget >= 0 and plan.reasoning is not None and not plan.reasoning.harmony:
            request.thinking = ThinkingBudget(
                budget,
                open_tag=plan.reasoning.open_tag,
                close_tag=plan.reasoning.close_tag,
                start_in_reasoning=plan.start_in_reasoning,
            )
        # Tool-call and reasoning markers are often special tokens: the parser must see them.
        request.skip_special = not plan.active
        body.stream_reports(request, stream=stream_reports)
        requests = per_choice(request, body.check_n(max_choices))
        job = Job.admit(state, requests)  # 400/503 here, before any SSE header
        return ChatJob(job=job, plan=plan, prompt_tokens=len(tokens), forced=forced)

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """Answer one request: JSON, or an SSE stream once admission succeeded."""
        verbose = body.wants_verbose(self.state.settings.verbose)
        job = await self.start(body, raw, max_choices=MAX_CHOICES, stream_reports=body.stream)
        meta = {
            "id": new_id("chatcmpl-"),
            "created": now(),
            "model": reported_model(self.state, body.model),
        }
        assert self.state.tokenizer is not None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        report = (
            VerboseReport(self.state, job.job.request, str(meta["model"]), stream=body.stream)
            if verbose
            else None
        )
        encoder = ChatEncoder(
            job, self.state.tokenizer, meta, include_usage=include_usage, verbose=report
        )
        return await job.job.respond(raw, encoder, stream=body.stream)

    async def prompt_text(self, body: ChatCompletionRequest) -> str:
        """The templated prompt as text (what POST /apply-template answers, without the BOS
        the tokenizer adds, as llama-server); 400 on errors."""
        assert self.state.tokenizer is not None
        return without_added_bos(self.state.tokenizer, (await self._render(body))[1])

    async def prompt_tokens(self, body: ChatCompletionRequest) -> list[int]:
        """The templated prompt's token ids (tools and `tool_choice` applied); 400 on errors."""
        return (await self._render(body))[2]

    async def _render(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, str, list[int]]:
        """(tools rendered, prompt text, prompt token ids) of `body`; 400 on errors."""
        tools, text, tokens, _ = await self._render_with_media(body)
        return tools, text, tokens

    async def _media_parts(
        self, body: ChatCompletionRequest
    ) -> tuple[list[list[dict[str, Any]] | None], VisionInputs | None]:
        """Per message, its content parts with media placeholders (None: plain text), and the
        decoded media — only on a vision model; text models refuse media parts (400)."""
        state = self.state
        contents = [m.content for m in body.messages]
        if state.media is None or not has_media([{"content": c} for c in contents]):
            return [None] * len(contents), None
        try:
            placed, inputs = await collect_media(
                [{"content": c} for c in contents], state.media_policy, state.media
            )
        except MediaError as exc:
            raise bad_request(str(exc)) from None
        parts = [m["content"] if isinstance(m["content"], list) else None for m in placed]
        return parts, inputs

    async def _render_with_media(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, str, list[int], VisionInputs | None]:
        """`_render`, plus the request's decoded media (None when it has none)."""
        state = self.state
        tokenizer = state.tokenizer
        assert tokenizer is not None
        tools, directive = _select_tools(body)
        kwargs = template_kwargs(state, body)
        contents, media = await self._media_parts(body)
        messages = [_template_message(i, m, contents[i]) for i, m in enumerate(body.messages)]
        if kwargs.get("preserve_thinking") is not True:
            messages = strip_think_blocks(messages)
        if directive:
            _add_directive(messages, directive)
        generation_prompt, prefill = assistant_prefill(body, messages)

        def render() -> tuple[str, list[int]]:
            text = render_chat(
                tokenizer,
                messages,
                add_generation_prompt=generation_prompt,
                tools=tools,
                template_kwargs=kwargs,
            )
            if prefill:
                text += prefill
            return text, tokenizer.encode(text, add_special=False)

        try:
            text, tokens = await run_in_threadpool(render)
        except PromptError as exc:
            raise bad_request(scrub_paths(str(exc))) from None
        return tools, text, tokens, media

    async def input_tokens(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """POST /v1/chat/completions/input_tokens: how many prompt tokens `body` would use."""
        if self.state.tokenizer is None:
            raise server_busy("loading model")
        tokens = await self.prompt_tokens(body)
        return {"input_tokens": len(tokens), "object": "response.input_tokens"}
